/* A host emulation of the CUDA C that aotfuse generates, for tests on machines without a GPU
 * (tests/cuda_emu.py). It replaces the generated source's prelude (everything before its
 * "#define AF_FN" line); the kernels and the shared helpers after it compile unchanged as C++.
 *
 * A launch runs one block at a time. Each CUDA thread of a block is a fiber (a ucontext with its own
 * stack) on the calling thread, and a scheduler resumes them in turn, alternately in increasing
 * and decreasing thread order, so that a read of another thread's write with no barrier between
 * them sees the stale value one way or the other. __syncthreads is a barrier over the block and
 * __shfl_xor_sync an exchange through memory between two barriers over the warp; a barrier some
 * thread never reaches is reported (emu_launch returns 4), not waited on forever. __shared__
 * arrays become function statics, which is right because only one block lives at a time. 16-bit floats convert with round-to-nearest-even in software (bf16) and
 * through _Float16 (fp16), as the GPU's cvt.rn instructions do. Nothing here is on the path a
 * model runs through. */
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>

struct af_dim3 {
    unsigned x, y, z;
};
/* one host thread runs every CUDA thread: the scheduler sets threadIdx before it resumes one */
static af_dim3 threadIdx, blockIdx, gridDim, blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

/* ---- CUDA threads as fibers ---- */

struct emu_fiber {
    ucontext_t ctx;
    char *stack;
    int done;
};
enum { EMU_STACK = 1 << 18 };
static emu_fiber emu_fibers[1024];
static ucontext_t emu_scheduler;
static unsigned emu_current;
static unsigned long emu_progress; /* arrivals at barriers and finished threads: a turn without any is a deadlock */

static void emu_yield() { swapcontext(&emu_fibers[emu_current].ctx, &emu_scheduler); }

/* `need` threads arrive; the last lets them all go on (a new generation) */
struct emu_barrier {
    unsigned need, count, gen;
};
static emu_barrier emu_block_barrier, emu_warp_barrier[32];

static void emu_barrier_wait(emu_barrier *b) {
    unsigned gen = b->gen;
    emu_progress++;
    if (++b->count == b->need) {
        b->count = 0;
        b->gen++;
        return;
    }
    while (b->gen == gen) emu_yield();
}

static double emu_slots[1024];

static inline void __syncthreads() { emu_barrier_wait(&emu_block_barrier); }

template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int m) {
    unsigned t = threadIdx.x, w = t / 32;
    emu_slots[t] = (double)v; /* every value our kernels exchange fits a double exactly */
    emu_barrier_wait(&emu_warp_barrier[w]);
    T r = (T)emu_slots[(t & ~31u) | ((t & 31u) ^ (unsigned)m)];
    emu_barrier_wait(&emu_warp_barrier[w]);
    return r;
}

template <typename T> static inline T __shfl_sync(unsigned, T v, int src) {
    unsigned t = threadIdx.x, w = t / 32;
    emu_slots[t] = (double)v;
    emu_barrier_wait(&emu_warp_barrier[w]);
    T r = (T)emu_slots[(t & ~31u) | ((unsigned)src & 31u)];
    emu_barrier_wait(&emu_warp_barrier[w]);
    return r;
}

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }

template <typename T, int N> struct alignas(sizeof(T) * N) af_vec { T x[N]; };

static inline float af_bf16_load(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
static inline uint16_t af_bf16_store(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float af_f16_load(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t af_f16_store(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
static inline float af_bf16_round(float f) { return af_bf16_load(af_bf16_store(f)); }
static inline uint16_t af_bf16_bits(float f) { return (uint16_t)(__float_as_uint(f) >> 16); }
static inline float af_f16_round(float f) { return af_f16_load(af_f16_store(f)); }
static inline float af_exp(float x) { return expf(x); }
static inline float af_exp_nonpos(float x) { return expf(x); }
static inline float af_erf(float x) { return erff(x); }
static inline float af_erf1p(float x) { return 1.0f + erff(x); }
static inline float af_tanh(float x) { return tanhf(x); }
static inline float af_log(float x) { return logf(x); }
static inline float af_log2(float x) { return log2f(x); }
static inline float af_log10(float x) { return log10f(x); }
static inline float af_log1p(float x) { return log1pf(x); }
static inline float af_expm1(float x) { return expm1f(x); }
static inline float af_sin(float x) { return sinf(x); }
static inline float af_cos(float x) { return cosf(x); }

/* ---- launching ---- */

typedef void (*emu_trampoline)(void **args);

static emu_trampoline emu_fn;
static void **emu_args;

/* one CUDA thread: every block of the grid in turn, a barrier after each (the block is done before
 * the next starts); threadIdx is set by the scheduler, blockIdx is the same for all live threads */
static void emu_fiber_main(int t) {
    for (unsigned by = 0; by < gridDim.y; by++)
        for (unsigned bx = 0; bx < gridDim.x; bx++) {
            blockIdx = af_dim3{bx, by, 0};
            emu_fn(emu_args);
            emu_barrier_wait(&emu_block_barrier);
        }
    emu_fibers[t].done = 1;
    emu_progress++;
}

/* Runs fn on a (gx, gy) grid of `threads`-thread blocks, one CUDA thread after another on the
 * calling thread: for kernels whose threads never meet (no __syncthreads, shuffle or shared memory),
 * the same results as emu_launch without a thread and barriers per CUDA thread. */
extern "C" int emu_launch_serial(emu_trampoline fn, void **args, unsigned gx, unsigned gy, unsigned threads) {
    if (threads == 0 || threads > 1024 || threads % 32 || gx == 0 || gy == 0) return 1;
    gridDim = af_dim3{gx, gy, 1};
    blockDim = af_dim3{threads, 1, 1};
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bx = 0; bx < gx; bx++)
            for (unsigned t = 0; t < threads; t++) {
                blockIdx = af_dim3{bx, by, 0};
                threadIdx = af_dim3{t, 0, 0};
                fn(args);
            }
    return 0;
}

/* Runs fn on a (gx, gy) grid of `threads`-thread blocks, each CUDA thread a fiber; 0 on success,
 * 3 where a fiber's stack cannot be allocated, 4 where the threads deadlock (a barrier that not
 * every thread of the block, or of the warp, reaches). */
extern "C" int emu_launch(emu_trampoline fn, void **args, unsigned gx, unsigned gy, unsigned threads) {
    if (threads == 0 || threads > 1024 || threads % 32 || gx == 0 || gy == 0) return 1;
    gridDim = af_dim3{gx, gy, 1};
    blockDim = af_dim3{threads, 1, 1};
    emu_fn = fn;
    emu_args = args;
    emu_block_barrier = emu_barrier{threads, 0, 0};
    for (unsigned w = 0; w < threads / 32; w++) emu_warp_barrier[w] = emu_barrier{32, 0, 0};
    for (unsigned t = 0; t < threads; t++) {
        emu_fiber *f = &emu_fibers[t];
        if (!f->stack && !(f->stack = (char *)malloc(EMU_STACK))) return 3; /* kept for later launches */
        if (getcontext(&f->ctx)) return 3;
        f->ctx.uc_stack.ss_sp = f->stack;
        f->ctx.uc_stack.ss_size = EMU_STACK;
        f->ctx.uc_link = &emu_scheduler;
        makecontext(&f->ctx, (void (*)())emu_fiber_main, 1, (int)t);
        f->done = 0;
    }
    unsigned live = threads;
    for (unsigned turn = 0; live; turn++) {
        unsigned long before = emu_progress;
        for (unsigned i = 0; i < threads; i++) {
            unsigned t = turn % 2 ? threads - 1 - i : i;
            if (emu_fibers[t].done) continue;
            emu_current = t;
            threadIdx = af_dim3{t, 0, 0};
            swapcontext(&emu_scheduler, &emu_fibers[t].ctx);
            live -= emu_fibers[t].done;
        }
        if (live && emu_progress == before) {
            fprintf(stderr, "cuda_emu: %u of %u threads wait at barriers no other thread reaches\n", live, threads);
            return 4;
        }
    }
    return 0;
}
