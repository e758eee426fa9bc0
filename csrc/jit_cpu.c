/* CPU JIT: system C compiler + dlopen + an atomic disk cache (see include/aotfuse/jit.h). */
#define _GNU_SOURCE
#include "aotfuse/jit.h"
#include "aotfuse/templates.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/wait.h>
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

/* Runs the compiler; on failure the message holds the start of its output. */
static int run_compiler(char *const *argv, const char *log_path) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int err = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (err) return af_error_set(AF_ERR_UNSUPPORTED, "cannot run the C compiler '%s' (%s): install one, or set AOTFUSE_CC, or AOTFUSE_FUSION=0 to run without fused kernels", argv[0], strerror(err));
    int status = 0;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return af_error_set(AF_ERR_RUNTIME, "waiting for the C compiler: %s", strerror(errno));
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return AF_OK;
    char log[700] = "";
    FILE *f = fopen(log_path, "r");
    if (f) {
        size_t got = fread(log, 1, sizeof log - 1, f);
        log[got] = '\0';
        fclose(f);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
        return af_error_set(AF_ERR_UNSUPPORTED, "the C compiler '%s' was not found: install one, or set AOTFUSE_CC, or AOTFUSE_FUSION=0", argv[0]);
    return af_error_set(AF_ERR_UNSUPPORTED, "the C compiler '%s' failed (status %d): %s", argv[0], status, log);
}

/* Chains the compiler's words and the flags into h. */
static uint64_t config_hash(uint64_t h) {
    char ccbuf[1024], *words[16];
    int n = compiler_words(ccbuf, sizeof ccbuf, words, 16);
    for (int i = 0; i < n; i++) h = af_jit_hash(h, words[i]);
    for (int i = 0; i < N_BASE_FLAGS; i++) h = af_jit_hash(h, base_flags[i]);
    if (vector_width_flag()) h = af_jit_hash(h, vector_width_flag());
    return h;
}

uint64_t af_jit_cpu_config(void) { return config_hash(af_jit_hash(14695981039346656037ull, JIT_VERSION)); }

/* dlopen + key check; 0 if the entry is missing, broken or someone else's. */
static void *open_checked(const char *path, const char *key) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return NULL;
    const char *k = dlsym(h, "af_module_key");
    if (!k || strcmp(k, key) != 0) {
        dlclose(h);
        return NULL;
    }
    return h;
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
    int st = AF_OK;
    /* a compiler without OpenMP's runtime (Apple's clang) still honours `omp simd` with
     * -fopenmp-simd: row sums add one float partial sum per vector lane only through it (a chunk
     * summed as one float was 10x less accurate); the last attempt takes neither */
    static const char *const omp_flags[] = {"-fopenmp", "-fopenmp-simd", NULL};
    for (int attempt = 0; attempt < 3; attempt++) {
        int k = n;
        for (int i = 0; i < N_BASE_FLAGS; i++) argv[k++] = (char *)base_flags[i];
        if (vector_width_flag()) argv[k++] = (char *)vector_width_flag();
        if (omp_flags[attempt]) argv[k++] = (char *)omp_flags[attempt];
        argv[k++] = tmp_c;
        argv[k++] = "-o";
        argv[k++] = tmp_so;
        argv[k++] = "-lm";
        argv[k] = NULL;
        st = run_compiler(argv, log);
        if (st == AF_OK) break;
        if (strstr(af_error_message(), "not found") || strstr(af_error_message(), "cannot run")) break;
    }
    unlink(log);
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
            if (!m->handle) st = af_error_set(AF_ERR_RUNTIME, "cannot load %s: %s", m->path, dlerror());
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
