/* CPU JIT: system C compiler + dlopen + an atomic disk cache (see include/aotfuse/jit.h). */
#define _GNU_SOURCE
#include "aotfuse/jit.h"
#include "aotfuse/templates.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define JIT_VERSION "aotfuse-jit-3"
/* -fno-math-errno / -fno-trapping-math let sqrt and selects vectorize; they change no result.
 * -fno-tree-pre: GCC's partial redundancy elimination turns `(float)(a == b) * c` with a row-invariant
 * c into a branch between two precomputed values, which the vectorizer then refuses ("control flow
 * in loop"); cross entropy's gradient kernel ran 2.4x slower with it (11.6 vs 4.9 ms at 512 x 8192).
 * Loop-invariant motion is a separate pass and stays on. */
static const char *const base_flags[] = {"-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off",
                                         "-fno-math-errno", "-fno-trapping-math", "-fno-tree-pre", "-w"};
#define N_BASE_FLAGS ((int)(sizeof base_flags / sizeof base_flags[0]))

/* On x86, GCC's and Clang's vectorizers prefer 256-bit vectors even where the CPU has AVX-512
 * (-march=native); torch's own kernels run 512-bit ones wherever its CPU capability is AVX512, and
 * ours follow it: exp- and erf-heavy kernels ran 1.5x faster (GELU at 512 x 1024: 0.73 -> 0.48 ms),
 * Bert's training step 6% (fp32) and 14% (bf16). ATEN_CPU_CAPABILITY set to anything below avx512
 * (torch's own switch) keeps 256. Without AVX-512 the flag changes nothing. */
static const char *vector_width_flag(void) {
#if defined(__x86_64__) || defined(__i386__)
    const char *cap = getenv("ATEN_CPU_CAPABILITY");
    if (cap && *cap && strncasecmp(cap, "avx512", 6) != 0) return NULL;
    return "-mprefer-vector-width=512";
#else
    return NULL;
#endif
}

struct af_jit_module {
    void *handle;
    char path[4096];
    int refs; /* under af_tmpl_lock */
};

uint64_t af_jit_hash(uint64_t h, const char *s) {
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h ^ 0xff; /* separator, so ("ab","c") and ("a","bc") differ */
}

static int mkdir_p(const char *dir) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s", dir) >= (int)sizeof tmp) return af_error_set(AF_ERR_INVALID, "cache path too long");
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return af_error_set(AF_ERR_RUNTIME, "cannot create %s: %s", tmp, strerror(errno));
            *p = '/';
        }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return af_error_set(AF_ERR_RUNTIME, "cannot create %s: %s", tmp, strerror(errno));
    return AF_OK;
}

int af_jit_cache_dir(char *out, size_t n) {
    const char *d = getenv("AOTFUSE_CACHE_DIR"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int w;
    if (d && *d) w = snprintf(out, n, "%s", d);
    else if (xdg && *xdg) w = snprintf(out, n, "%s/aotfuse", xdg);
    else if (home && *home) w = snprintf(out, n, "%s/.cache/aotfuse", home);
    else w = snprintf(out, n, "/tmp/aotfuse-cache-%d", (int)getuid());
    if (w < 0 || (size_t)w >= n) return af_error_set(AF_ERR_INVALID, "cache directory path too long");
    return mkdir_p(out);
}

/* Splits AOTFUSE_CC ("ccache gcc") into argv words, in buf. */
static int compiler_words(char *buf, size_t n, char **words, int max) {
    const char *cc = getenv("AOTFUSE_CC");
    if (!cc || !*cc) cc = "cc";
    if (snprintf(buf, n, "%s", cc) >= (int)n) return -1;
    int k = 0;
    char *save = NULL; /* strtok_r: the kernel templates ask for the compiler's words too */
    for (char *tok = strtok_r(buf, " \t", &save); tok && k < max; tok = strtok_r(NULL, " \t", &save)) words[k++] = tok;
    return k;
}

/* Starts the compiler, its output into log_path. */
static int spawn_compiler(char *const *argv, const char *log_path, pid_t *pid) {
    posix_spawn_file_actions_t fa;
    if (posix_spawn_file_actions_init(&fa) != 0) return af_error_set(AF_ERR_NOMEM, "out of memory starting the C compiler");
    int err = posix_spawn_file_actions_addopen(&fa, 1, log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (!err) err = posix_spawn_file_actions_adddup2(&fa, 1, 2);
    if (!err) err = posix_spawnp(pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (err) return af_error_set(AF_ERR_UNSUPPORTED, "cannot run the C compiler '%s' (%s): install one, or set AOTFUSE_CC, or AOTFUSE_FUSION=0 to run without fused kernels", argv[0], strerror(err));
    return AF_OK;
}

static int (*interrupt_check)(void);
static int interrupted; /* this load was stopped: no compiler is started or waited for again */

void af_jit_set_interrupt_check(int (*check)(void)) { interrupt_check = check; }

/* A descriptor that polls readable when the child exits (Linux 5.3+), or -1. */
static int child_fd(pid_t pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

/* Waits for a compiler spawn_compiler started; on failure the message holds the start of its output.
 * A signal whose handler says stop (interrupt_check) kills it. The handler is asked before each wait
 * of at most 100 ms, not only when a wait fails with EINTR: a signal delivered to another thread, or
 * before the wait began, interrupts no wait, and the build hung until the compiler ended. */
static int wait_compiler(pid_t pid, const char *argv0, const char *log_path) {
    int status = 0, fd = child_fd(pid);
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) break;
        if (r < 0 && errno != EINTR) {
            int e = errno;
            if (fd >= 0) close(fd);
            return af_error_set(AF_ERR_RUNTIME, "waiting for the C compiler: %s", strerror(e));
        }
        if (interrupted || (interrupt_check && interrupt_check())) {
            interrupted = 1;
            kill(pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
            }
            if (fd >= 0) close(fd);
            return af_error_set(AF_ERR_RUNTIME, "interrupted while the C compiler '%s' ran", argv0);
        }
        if (fd >= 0) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            (void)poll(&p, 1, 100); /* the exit, a signal (EINTR) or 100 ms */
        } else {
            struct timespec ts = {.tv_sec = 0, .tv_nsec = 2000000};
            (void)nanosleep(&ts, NULL);
        }
    }
    if (fd >= 0) close(fd);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return AF_OK;
    char log[700] = "";
    FILE *f = fopen(log_path, "r");
    if (f) {
        size_t got = fread(log, 1, sizeof log - 1, f);
        log[got] = '\0';
        fclose(f);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
        return af_error_set(AF_ERR_UNSUPPORTED, "the C compiler '%s' was not found: install one, or set AOTFUSE_CC, or AOTFUSE_FUSION=0", argv0);
    if (WIFSIGNALED(status))
        return af_error_set(AF_ERR_UNSUPPORTED, "the C compiler '%s' was killed by signal %d: %s", argv0,
                            WTERMSIG(status), log);
    return af_error_set(AF_ERR_UNSUPPORTED, "the C compiler '%s' failed (exit code %d)%s%s", argv0,
                        WIFEXITED(status) ? WEXITSTATUS(status) : status, *log ? ": " : ", with no output",
                        log);
}

/* Runs the compiler; on failure the message holds the start of its output. */
static int run_compiler(char *const *argv, const char *log_path) {
    pid_t pid;
    int st = spawn_compiler(argv, log_path, &pid);
    return st ? st : wait_compiler(pid, argv[0], log_path);
}

/* The CPU's identity for -march=native: /proc/cpuinfo's first processor's model and instruction set
 * lines (x86's "model name" and "flags", ARM's "CPU part" and "Features"), hashed once. A cache
 * folder shared between machines (a network home, a container image) then never hands one CPU
 * another's instructions. 0 where there is no /proc/cpuinfo. */
static uint64_t cpu_identity(void) {
    static uint64_t id;
    static int done;
    if (__atomic_load_n(&done, __ATOMIC_ACQUIRE)) return id;
    uint64_t h = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        static const char *const keys[] = {"model name", "flags", "CPU implementer", "CPU part", "Features"};
        char line[8192];
        h = 14695981039346656037ull;
        while (fgets(line, sizeof line, f)) {
            if (line[0] == '\n') break; /* the first processor's block only */
            for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
                if (strncmp(line, keys[k], strlen(keys[k])) == 0) h = af_jit_hash(h, line);
        }
        fclose(f);
    }
    id = h;
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    return id;
}

/* Chains the compiler's words and the flags into h. */
static uint64_t config_hash(uint64_t h) {
    char ccbuf[1024], *words[16];
    int n = compiler_words(ccbuf, sizeof ccbuf, words, 16);
    for (int i = 0; i < n; i++) h = af_jit_hash(h, words[i]);
    for (int i = 0; i < N_BASE_FLAGS; i++) h = af_jit_hash(h, base_flags[i]);
    if (vector_width_flag()) h = af_jit_hash(h, vector_width_flag());
    char cpu[32];
    snprintf(cpu, sizeof cpu, "cpu %016" PRIx64, cpu_identity());
    return af_jit_hash(h, cpu);
}

uint64_t af_jit_cpu_config(void) { return config_hash(af_jit_hash(14695981039346656037ull, JIT_VERSION)); }

/* Whether path is a regular file holding a whole ELF object: its header, its program and section
 * header tables and every segment's bytes inside the file. dlopen maps a truncated object whose
 * header survived and dies on the missing pages (SIGBUS), and blocks on a FIFO. */
static int elf_complete(const char *path) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat sb;
    ElfW(Ehdr) eh;
    int ok = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size >= (off_t)sizeof eh &&
             pread(fd, &eh, sizeof eh, 0) == (ssize_t)sizeof eh && memcmp(eh.e_ident, ELFMAG, SELFMAG) == 0 &&
             eh.e_phentsize == sizeof(ElfW(Phdr));
    uint64_t size = ok ? (uint64_t)sb.st_size : 0;
    ok = ok && eh.e_phoff <= size && (uint64_t)eh.e_phnum * eh.e_phentsize <= size - eh.e_phoff;
    ok = ok && (eh.e_shoff == 0 || (eh.e_shoff <= size && (uint64_t)eh.e_shnum * eh.e_shentsize <= size - eh.e_shoff));
    for (int i = 0; ok && i < eh.e_phnum; i++) {
        ElfW(Phdr) ph;
        ok = pread(fd, &ph, sizeof ph, (off_t)(eh.e_phoff + (uint64_t)i * sizeof ph)) == (ssize_t)sizeof ph &&
             ph.p_offset <= size && ph.p_filesz <= size - ph.p_offset;
    }
    close(fd);
    return ok;
}

/* dlopen + key check; 0 if the entry is missing, broken or someone else's. */
static void *open_checked(const char *path, const char *key) {
    if (!elf_complete(path)) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return NULL;
    const char *k = dlsym(h, "af_module_key");
    if (!k || strcmp(k, key) != 0) {
        dlclose(h);
        return NULL;
    }
    return h;
}

/* ---------------------------------------------------------------- parallel compile (jit.h) */

/* About a tenth of a second of `cc -O3`: a part smaller than this costs another compiler's start
 * and a link for less than it saves. */
#define MIN_PART_BYTES 12000
#define MAX_PARTS 64

/* Compilers one module may run at once: AOTFUSE_JIT_JOBS, else the CPUs this process may use (at
 * most 16); a value that is not a positive integer is ignored. */
static int jit_jobs(void) {
    const char *e = getenv("AOTFUSE_JIT_JOBS");
    if (e && *e) {
        char *end = NULL;
        long v = strtol(e, &end, 10);
        if (end && *end == '\0' && v >= 1) return v > MAX_PARTS ? MAX_PARTS : (int)v;
    }
    long n = 0;
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
#endif
    if (n <= 0) n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 16 ? 16 : (int)n;
}

/* The OpenMP flag the compiler takes, probed once per compiler (AOTFUSE_CC) in a process: a small
 * source with `omp parallel for` and `omp simd` built as a shared object with -fopenmp, else with
 * -fopenmp-simd (a compiler without OpenMP's runtime, Apple's clang, still honours `omp simd` with
 * it: row sums add one float partial sum per vector lane only through it, and a chunk summed as one
 * float was 10x less accurate), else with neither. A program's source is then compiled once with
 * that flag, so that an error in the source is the compiler's own error: it used to be retried
 * without OpenMP, and a source whose error was in an OpenMP pragma then built, on one thread and
 * without the per-lane sums, slower and less accurate with nothing said. Returns the flag or NULL
 * (neither); a compiler that cannot be run gets NULL, and the source's compile says why. */
static pthread_mutex_t omp_probe_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *omp_flag(const char *dir, long salt) {
    static const char *const flags[] = {"-fopenmp", "-fopenmp-simd"};
    static char probed_cc[1024];
    static int probed = -1; /* index into flags, 2 for neither; -1 before the first probe */
    const char *cc = getenv("AOTFUSE_CC");
    if (!cc || !*cc) cc = "cc";
    pthread_mutex_lock(&omp_probe_lock);
    if (probed >= 0 && strcmp(probed_cc, cc) == 0) {
        int k = probed;
        pthread_mutex_unlock(&omp_probe_lock);
        return k < 2 ? flags[k] : NULL;
    }
    char src[4200], so[4200], log[4200], ccbuf[1024];
    snprintf(src, sizeof src, "%s/.omp-probe.%ld.c", dir, salt);
    snprintf(so, sizeof so, "%s/.omp-probe.%ld.so", dir, salt);
    snprintf(log, sizeof log, "%s/.omp-probe.%ld.log", dir, salt);
    int found = 2;
    FILE *f = fopen(src, "w");
    if (f) {
        int ok = fputs("void af_probe(float *restrict a, const float *restrict b, int n) {\n"
                       "  #pragma omp parallel for schedule(static)\n"
                       "  for (int c = 0; c < n; c++) {\n"
                       "    float s = 0.0f;\n"
                       "    #pragma omp simd reduction(+:s)\n"
                       "    for (int i = 0; i < 64; i++) s += b[c * 64 + i];\n"
                       "    a[c] = s;\n"
                       "  }\n"
                       "}\n", f) >= 0;
        ok &= fclose(f) == 0;
        char *argv[32];
        int n = ok ? compiler_words(ccbuf, sizeof ccbuf, argv, 16) : 0;
        for (int k = 0; k < 2 && n > 0 && !interrupted; k++) {
            int m = n;
            argv[m++] = "-O2";
            argv[m++] = "-shared";
            argv[m++] = "-fPIC";
            argv[m++] = (char *)flags[k];
            argv[m++] = src;
            argv[m++] = "-o";
            argv[m++] = so;
            argv[m] = NULL;
            if (run_compiler(argv, log) == AF_OK) {
                found = k;
                break;
            }
        }
        af_error_clear();
    }
    unlink(src);
    unlink(so);
    unlink(log);
    if (!interrupted) { /* a probe stopped by Ctrl-C says nothing of the compiler */
        snprintf(probed_cc, sizeof probed_cc, "%s", cc);
        probed = found;
    }
    pthread_mutex_unlock(&omp_probe_lock);
    return found < 2 ? flags[found] : NULL;
}

/* Set once a split compile failed where the one-file compile then worked (a compiler that wants
 * other flags, say): later modules go straight to the one-file path. */
static int split_broken;

typedef struct {
    size_t at, len; /* from its AF_C_UNIT_MARK line to the next one (or the end) */
    size_t index;
} unit_span;

static int longer_first(const void *a, const void *b) {
    const unit_span *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->index < y->index ? -1 : 1;
}

/* Writes the prelude and the units of part j (in source order); part 0 also gets the key. */
static int write_part(const char *path, const char *source, size_t prelude, const unit_span *units, size_t n_units,
                      const int *part_of, int j, const char *key) {
    FILE *f = fopen(path, "w");
    if (!f) return 0;
    int ok = fwrite(source, 1, prelude, f) == prelude;
    for (size_t u = 0; u < n_units && ok; u++)
        if (part_of[u] == j) ok = fwrite(source + units[u].at, 1, units[u].len, f) == units[u].len;
    if (j == 0 && ok) ok = fprintf(f, "\nconst char af_module_key[] = \"%s\";\n", key) > 0;
    ok &= fclose(f) == 0;
    return ok;
}

/* Compiles source into tmp_so as parts compiled at once and linked; 1 if it did, 0 where the
 * source is too small to split, jobs is 1, or anything failed (*tried then says it ran a compiler;
 * the caller compiles the source as one file, which reports the compiler's own error). Every file
 * it writes is removed. */
static int split_compile(const char *dir, const char *key, long salt, const char *source, const char *tmp_so, const char *omp,
                         int *tried) {
    int jobs = jit_jobs();
    if (jobs < 2 || __atomic_load_n(&split_broken, __ATOMIC_RELAXED)) return 0;
    const char *first = strstr(source, AF_C_UNIT_MARK "\n");
    if (!first) return 0;
    size_t prelude = (size_t)(first - source), n_units = 0, total = strlen(source) - prelude;
    for (const char *q = first; q; q = strstr(q + 1, "\n" AF_C_UNIT_MARK "\n")) n_units++;
    size_t parts = (size_t)jobs;
    if (parts > n_units) parts = n_units;
    if (parts > total / MIN_PART_BYTES) parts = total / MIN_PART_BYTES;
    if (parts < 2) return 0;

    unit_span *units = calloc(n_units, sizeof *units), *order = calloc(n_units, sizeof *order);
    int *part_of = calloc(n_units, sizeof *part_of);
    char(*paths)[3][4200] = calloc(parts, sizeof *paths); /* .c, .o, .log of each part */
    pid_t *pids = calloc(parts, sizeof *pids);
    char **argv = calloc(16 + N_BASE_FLAGS + 8 + parts, sizeof *argv);
    size_t loads[MAX_PARTS] = {0};
    int ok = units && order && part_of && paths && pids && argv;
    size_t u = 0;
    for (const char *q = first; ok && q; u++) {
        const char *next = strstr(q + 1, "\n" AF_C_UNIT_MARK "\n");
        units[u].at = (size_t)(q - source);
        units[u].len = next ? (size_t)(next + 1 - q) : strlen(q);
        units[u].index = u;
        q = next ? next + 1 : NULL;
    }
    if (ok) { /* the longest unit first, each to the lightest part */
        memcpy(order, units, n_units * sizeof *units);
        qsort(order, n_units, sizeof *order, longer_first);
        for (size_t k = 0; k < n_units; k++) {
            size_t light = 0;
            for (size_t j = 1; j < parts; j++)
                if (loads[j] < loads[light]) light = j;
            part_of[order[k].index] = (int)light;
            loads[light] += order[k].len;
        }
    }
    size_t written = 0, started = 0;
    for (; ok && written < parts; written++) {
        snprintf(paths[written][0], sizeof paths[written][0], "%s/.%s.%ld.p%zu.c", dir, key, salt, written);
        snprintf(paths[written][1], sizeof paths[written][1], "%s/.%s.%ld.p%zu.o", dir, key, salt, written);
        snprintf(paths[written][2], sizeof paths[written][2], "%s/.%s.%ld.p%zu.log", dir, key, salt, written);
        ok = write_part(paths[written][0], source, prelude, units, n_units, part_of, (int)written, key);
    }
    char ccbuf[1024];
    int n = ok ? compiler_words(ccbuf, sizeof ccbuf, argv, 16) : 0;
    ok &= n > 0;
    *tried = ok;
    while (ok && started < parts) { /* started counts the compilers running: only they are waited for */
        int k = n;
        for (int i = 0; i < N_BASE_FLAGS; i++)
            if (strcmp(base_flags[i], "-shared") != 0) argv[k++] = (char *)base_flags[i];
        if (vector_width_flag()) argv[k++] = (char *)vector_width_flag();
        if (omp) argv[k++] = (char *)omp;
        argv[k++] = "-c";
        argv[k++] = paths[started][0];
        argv[k++] = "-o";
        argv[k++] = paths[started][1];
        argv[k] = NULL;
        ok = spawn_compiler(argv, paths[started][2], &pids[started]) == AF_OK;
        if (ok) started++;
    }
    for (size_t j = 0; j < started; j++) { /* waits for all; once interrupted, kills the rest first */
        if (interrupted) kill(pids[j], SIGKILL);
        ok &= wait_compiler(pids[j], argv[0], paths[j][2]) == AF_OK;
    }
    if (ok && !interrupted) {
        int k = n;
        argv[k++] = "-shared";
        argv[k++] = "-fPIC";
        if (omp) argv[k++] = (char *)omp;
        for (size_t j = 0; j < parts; j++) argv[k++] = paths[j][1];
        argv[k++] = "-o";
        argv[k++] = (char *)tmp_so;
        argv[k++] = "-lm";
        argv[k] = NULL;
        ok = run_compiler(argv, paths[0][2]) == AF_OK;
    }
    for (size_t j = 0; j < written; j++)
        for (int e = 0; e < 3; e++) unlink(paths[j][e]);
    if (!ok) unlink(tmp_so);
    free(units);
    free(order);
    free(part_of);
    free(paths);
    free(pids);
    free(argv);
    return ok;
}

static int compile_to(const char *dir, const char *key, const char *source, const char *final_path) {
    char tmp_c[4200], tmp_so[4200], log[4200];
    long salt = (long)getpid() ^ ((long)(uintptr_t)&salt >> 4);
    snprintf(tmp_c, sizeof tmp_c, "%s/.%s.%ld.c", dir, key, salt);
    snprintf(tmp_so, sizeof tmp_so, "%s/.%s.%ld.so", dir, key, salt);
    snprintf(log, sizeof log, "%s/.%s.%ld.log", dir, key, salt);
    FILE *f = fopen(tmp_c, "w");
    if (!f) return af_error_set(AF_ERR_RUNTIME, "cannot write %s: %s", tmp_c, strerror(errno));
    int ok = fputs(source, f) >= 0;
    ok &= fprintf(f, "\nconst char af_module_key[] = \"%s\";\n", key) > 0;
    ok &= fclose(f) == 0;
    if (!ok) {
        unlink(tmp_c);
        return af_error_set(AF_ERR_RUNTIME, "cannot write %s", tmp_c);
    }
    char ccbuf[1024];
    char *argv[64];
    int n = compiler_words(ccbuf, sizeof ccbuf, argv, 16);
    if (n <= 0) {
        unlink(tmp_c);
        return af_error_set(AF_ERR_INVALID, "AOTFUSE_CC is empty or too long");
    }
    const char *omp = omp_flag(dir, salt); /* -fopenmp, -fopenmp-simd or neither (omp_flag) */
    int st = AF_OK, tried = 0, split = !interrupted && split_compile(dir, key, salt, source, tmp_so, omp, &tried);
    if (!split && !interrupted) {
        int k = n;
        for (int i = 0; i < N_BASE_FLAGS; i++) argv[k++] = (char *)base_flags[i];
        if (vector_width_flag()) argv[k++] = (char *)vector_width_flag();
        if (omp) argv[k++] = (char *)omp;
        argv[k++] = tmp_c;
        argv[k++] = "-o";
        argv[k++] = tmp_so;
        argv[k++] = "-lm";
        argv[k] = NULL;
        st = run_compiler(argv, log);
    }
    unlink(log);
    if (interrupted && st == AF_OK) st = af_error_set(AF_ERR_RUNTIME, "interrupted while the C compiler ran");
    if (tried && !split && st == AF_OK) __atomic_store_n(&split_broken, 1, __ATOMIC_RELAXED);
    if (st == AF_OK) { /* on disk before it takes the cache's name: a crash leaves no partial entry */
        int fd = open(tmp_so, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)fsync(fd);
            close(fd);
        }
    }
    if (st == AF_OK && rename(tmp_so, final_path) != 0)
        st = af_error_set(AF_ERR_RUNTIME, "cannot move %s into the cache: %s", tmp_so, strerror(errno));
    if (st != AF_OK) unlink(tmp_so);
    /* keep the source beside the object for AOTFUSE_LOG=codegen readers and bug reports */
    char src_path[4200];
    snprintf(src_path, sizeof src_path, "%s/%s.c", dir, key);
    if (st != AF_OK || rename(tmp_c, src_path) != 0) unlink(tmp_c);
    return st;
}

int af_jit_cpu_load(const char *source, af_jit_module **out, int *cache_hit) {
    if (!source || !out) return af_error_set(AF_ERR_INVALID, "af_jit_cpu_load: NULL argument");
    interrupted = 0;
    char dir[4000];
    int st = af_jit_cache_dir(dir, sizeof dir);
    if (st) return st;
    uint64_t h = af_jit_hash(14695981039346656037ull, JIT_VERSION);
    h = af_jit_hash(h, source);
    h = config_hash(h);
    char key[32];
    snprintf(key, sizeof key, "%016" PRIx64, h);
    af_jit_module *m = calloc(1, sizeof *m);
    if (!m) return af_error_set(AF_ERR_NOMEM, "out of memory loading a module");
    m->refs = 1;
    snprintf(m->path, sizeof m->path, "%s/%s.so", dir, key);
    int hit = 1;
    m->handle = open_checked(m->path, key);
    if (!m->handle) {
        hit = 0;
        unlink(m->path); /* missing, truncated, corrupt or stale: rebuild */
        if ((st = compile_to(dir, key, source, m->path)) == AF_OK) {
            m->handle = open_checked(m->path, key);
            if (!m->handle) {
                const char *why = dlerror();
                st = af_error_set(AF_ERR_UNSUPPORTED, "cannot load %s, which the C compiler built: %s", m->path,
                                  why ? why : "not a complete shared object");
            }
        }
    }
    if (st) {
        free(m);
        return st;
    }
    if (cache_hit) *cache_hit = hit;
    *out = m;
    return AF_OK;
}

void *af_jit_symbol(af_jit_module *m, const char *name) { return m && m->handle ? dlsym(m->handle, name) : NULL; }

const char *af_jit_path(const af_jit_module *m) { return m ? m->path : ""; }

void af_jit_module_retain_locked(af_jit_module *m) { m->refs++; }

void af_jit_module_free(af_jit_module *m) {
    if (!m) return;
    af_tmpl_lock();
    int last = --m->refs == 0;
    if (last) af_tmpl_forget_locked(m); /* no body of it can be found any more */
    af_tmpl_unlock();
    if (!last) return;
    if (m->handle) dlclose(m->handle);
    free(m);
}
