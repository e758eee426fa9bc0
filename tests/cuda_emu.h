/* A host emulation of the CUDA C that aotfuse generates, for tests on machines without a GPU
 * (tests/cuda_emu.py). It replaces the generated source's prelude (everything before its
 * "#define AF_FN" line); the kernels and the shared helpers after it compile unchanged as C++.
 *
 * A launch runs one block at a time; the block's threads are real threads, so __syncthreads is a
 * barrier over the block and __shfl_xor_sync an exchange through memory between two barriers over
 * the warp. __shared__ arrays become function statics, which is right because only one block
 * lives at a time. 16-bit floats convert with round-to-nearest-even in software (bf16) and
 * through _Float16 (fp16), as the GPU's cvt.rn instructions do. Nothing here is on the path a
 * model runs through. */
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <pthread.h>

struct af_dim3 {
    unsigned x, y, z;
};
static thread_local af_dim3 threadIdx, blockIdx;
static af_dim3 gridDim, blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

static pthread_barrier_t emu_block_barrier;
static pthread_barrier_t emu_warp_barrier[32];
static double emu_slots[1024];

static inline void __syncthreads() { pthread_barrier_wait(&emu_block_barrier); }

template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int m) {
    unsigned t = threadIdx.x, w = t / 32;
    emu_slots[t] = (double)v; /* every value our kernels exchange fits a double exactly */
    pthread_barrier_wait(&emu_warp_barrier[w]);
    T r = (T)emu_slots[(t & ~31u) | ((t & 31u) ^ (unsigned)m)];
    pthread_barrier_wait(&emu_warp_barrier[w]);
    return r;
}

template <typename T> static inline T __shfl_sync(unsigned, T v, int src) {
    unsigned t = threadIdx.x, w = t / 32;
    emu_slots[t] = (double)v;
    pthread_barrier_wait(&emu_warp_barrier[w]);
    T r = (T)emu_slots[(t & ~31u) | ((unsigned)src & 31u)];
    pthread_barrier_wait(&emu_warp_barrier[w]);
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

struct emu_launch_state {
    emu_trampoline fn;
    void **args;
};

static void *emu_thread(void *arg) {
    emu_launch_state *s = (emu_launch_state *)arg;
    for (unsigned by = 0; by < gridDim.y; by++)
        for (unsigned bx = 0; bx < gridDim.x; bx++) {
            blockIdx = af_dim3{bx, by, 0};
            s->fn(s->args);
            pthread_barrier_wait(&emu_block_barrier); /* the block is done before the next starts */
        }
    return nullptr;
}

struct emu_thread_arg {
    emu_launch_state *s;
    unsigned tid;
};

static void *emu_thread_start(void *arg) {
    emu_thread_arg *a = (emu_thread_arg *)arg;
    threadIdx = af_dim3{a->tid, 0, 0};
    return emu_thread(a->s);
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

/* Runs fn on a (gx, gy) grid of `threads`-thread blocks; 0 on success. */
extern "C" int emu_launch(emu_trampoline fn, void **args, unsigned gx, unsigned gy, unsigned threads) {
    if (threads == 0 || threads > 1024 || threads % 32 || gx == 0 || gy == 0) return 1;
    gridDim = af_dim3{gx, gy, 1};
    blockDim = af_dim3{threads, 1, 1};
    if (pthread_barrier_init(&emu_block_barrier, nullptr, threads)) return 2;
    unsigned warps = threads / 32;
    for (unsigned w = 0; w < warps; w++) pthread_barrier_init(&emu_warp_barrier[w], nullptr, 32);
    emu_launch_state s = {fn, args};
    pthread_t tids[1024];
    emu_thread_arg targs[1024];
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 18);
    unsigned started = 0;
    int rc = 0;
    for (; started < threads; started++) {
        targs[started] = emu_thread_arg{&s, started};
        if (pthread_create(&tids[started], &attr, emu_thread_start, &targs[started])) {
            rc = 3;
            break;
        }
    }
    pthread_attr_destroy(&attr);
    if (rc) { /* a partial block would wait forever at its first barrier */
        fprintf(stderr, "cuda_emu: cannot start %u threads\n", threads);
        abort();
    }
    for (unsigned t = 0; t < started; t++) pthread_join(tids[t], nullptr);
    pthread_barrier_destroy(&emu_block_barrier);
    for (unsigned w = 0; w < warps; w++) pthread_barrier_destroy(&emu_warp_barrier[w]);
    return rc;
}
