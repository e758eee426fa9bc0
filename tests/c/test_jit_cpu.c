/* CMocka tests of the CPU JIT's parallel compile (csrc/jit_cpu.c, jit.h): a source with
 * AF_C_UNIT_MARK lines, large enough, is compiled as several files at once and linked into one
 * shared object whose functions reach each other across the files; AOTFUSE_JIT_JOBS=1 and small
 * sources compile as one file; a compiler that fails on the parts still builds the module, as one
 * file, and later modules skip the split; the OpenMP flag is probed once per compiler and a source's
 * error is not retried without it. The compiler is a shell script that logs its arguments
 * and runs `cc`. Under valgrind (AOTFUSE_TEST_NO_RUN=1, set by `make valgrind`) the functions are
 * looked up but not called (-march=native code). The last test leaves the split turned off for
 * the process: keep it last. */
#define _DEFAULT_SOURCE /* fork, sleep, mkdtemp */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "aotfuse/jit.h"

typedef struct {
    char dir[64];
    char cc[128];
    char log[128];
} sandbox;

/* A fresh cache folder with a logging compiler in it (failing on `-c` when fail_parts). */
static void sandbox_new(sandbox *s, int fail_parts) {
    snprintf(s->dir, sizeof s->dir, "/tmp/aotfuse-jit-test-XXXXXX");
    assert_non_null(mkdtemp(s->dir));
    snprintf(s->cc, sizeof s->cc, "%s/cc-log", s->dir);
    snprintf(s->log, sizeof s->log, "%s/calls", s->dir);
    FILE *f = fopen(s->cc, "w");
    assert_non_null(f);
    fprintf(f, "#!/bin/sh\necho \"$*\" >> '%s'\n", s->log);
    if (fail_parts) fprintf(f, "for a in \"$@\"; do [ \"$a\" = \"-c\" ] && { echo 'no -c here' >&2; exit 1; }; done\n");
    fprintf(f, "exec cc \"$@\"\n");
    assert_int_equal(fclose(f), 0);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "chmod +x '%s'", s->cc);
    assert_int_equal(system(cmd), 0);
    setenv("AOTFUSE_CACHE_DIR", s->dir, 1);
    setenv("AOTFUSE_CC", s->cc, 1);
}

static void sandbox_free(sandbox *s) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
    assert_int_equal(system(cmd), 0);
    unsetenv("AOTFUSE_CC");
    unsetenv("AOTFUSE_JIT_JOBS");
}

/* OpenMP probes logged so far (omp_flag: one per compiler in a process). */
static int count_probes(const sandbox *s) {
    int n = 0;
    FILE *f = fopen(s->log, "r");
    if (!f) return 0;
    char line[8192];
    while (fgets(line, sizeof line, f)) n += strstr(line, "omp-probe") != NULL;
    fclose(f);
    return n;
}

/* Compiler calls logged so far, the OpenMP probes left out: all of them, and those compiling a
 * part (`-c`). */
static void count_calls(const sandbox *s, int *calls, int *parts, int *links) {
    *calls = *parts = *links = 0;
    FILE *f = fopen(s->log, "r");
    if (!f) return;
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "omp-probe")) continue;
        (*calls)++;
        if (strstr(line, " -c ")) (*parts)++;
        if (strstr(line, ".o ") && strstr(line, "-shared")) (*links)++;
    }
    fclose(f);
}

/* Temporary files (names starting with a dot) left in the cache folder. */
static int leftovers(const sandbox *s) {
    DIR *d = opendir(s->dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] == '.' && strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
    closedir(d);
    return n;
}

/* A prelude and two units of about `pad` bytes each: the first defines af_body_0 (reading the
 * global the second defines), the second declares and calls it. `salt` makes sources differ. */
static char *two_unit_source(size_t pad, int salt) {
    char *src = malloc(2 * pad + 1024);
    assert_non_null(src);
    char *fill = malloc(pad + 1);
    assert_non_null(fill);
    memset(fill, 'x', pad);
    fill[pad] = '\0';
    snprintf(src, 2 * pad + 1024,
             "#include <stdint.h>\n"
             "extern int af_num_threads;\n"
             "\n" AF_C_UNIT_MARK "\n"
             "/* %s */\n"
             "int af_body_0(int x) { return x * %d + af_num_threads; }\n"
             "\n" AF_C_UNIT_MARK "\n"
             "/* %s */\n"
             "int af_body_0(int);\n"
             "int af_kernel_1(int x) { return af_body_0(x) + 100; }\n"
             "int af_num_threads = 1;\n",
             fill, 2 + salt, fill);
    free(fill);
    return src;
}

static int no_run(void) { return getenv("AOTFUSE_TEST_NO_RUN") != NULL; }

static void check_module(af_jit_module *m, int salt) {
    int (*body)(int) = NULL, (*kernel)(int) = NULL;
    *(void **)&body = af_jit_symbol(m, "af_body_0");
    *(void **)&kernel = af_jit_symbol(m, "af_kernel_1");
    assert_non_null(body);
    assert_non_null(kernel);
    assert_non_null(af_jit_symbol(m, "af_module_key"));
    if (no_run()) return;
    assert_int_equal(body(5), 5 * (2 + salt) + 1);
    assert_int_equal(kernel(5), 5 * (2 + salt) + 1 + 100);
}

/* Two large units, two jobs: two part compiles at once and one link; the functions call across
 * the parts; the whole source is kept beside the object; a second load is a cache hit. */
static void test_a_large_source_compiles_in_parts(void **state) {
    (void)state;
    sandbox s;
    sandbox_new(&s, 0);
    setenv("AOTFUSE_JIT_JOBS", "2", 1);
    char *src = two_unit_source(20000, 0);
    af_jit_module *m = NULL;
    int hit = -1, calls, parts, links;
    assert_int_equal(af_jit_cpu_load(src, &m, &hit), AF_OK);
    assert_int_equal(hit, 0);
    count_calls(&s, &calls, &parts, &links);
    assert_int_equal(parts, 2);
    assert_int_equal(links, 1);
    assert_int_equal(calls, 3);
    check_module(m, 0);
    assert_int_equal(leftovers(&s), 0);
    char kept[256];
    snprintf(kept, sizeof kept, "%s", af_jit_path(m)); /* <key>.so -> <key>.c */
    assert_true(strlen(kept) > 3 && strcmp(kept + strlen(kept) - 3, ".so") == 0);
    strcpy(kept + strlen(kept) - 3, ".c");
    FILE *f = fopen(kept, "r");
    assert_non_null(f); /* the whole source, not a part */
    char *text = calloc(1, 2 * 20000 + 2048);
    assert_non_null(text);
    size_t got = fread(text, 1, 2 * 20000 + 2047, f);
    fclose(f);
    assert_true(got > 40000);
    assert_non_null(strstr(text, "af_kernel_1"));
    assert_non_null(strstr(text, "return x * 2"));
    free(text);
    af_jit_module *again = NULL;
    assert_int_equal(af_jit_cpu_load(src, &again, &hit), AF_OK);
    assert_int_equal(hit, 1);
    count_calls(&s, &calls, &parts, &links);
    assert_int_equal(calls, 3);
    check_module(again, 0);
    af_jit_module_free(again);
    af_jit_module_free(m);
    free(src);
    sandbox_free(&s);
}

/* AOTFUSE_JIT_JOBS=1, or a source too small to be worth a second compiler: one compile. A value
 * that is not a positive integer is ignored (the default, here with a small source). */
static void test_one_job_or_a_small_source_compiles_as_one_file(void **state) {
    (void)state;
    const struct {
        const char *jobs;
        size_t pad;
    } cases[] = {{"1", 20000}, {"2", 100}, {"zero", 100}, {"-3", 100}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        sandbox s;
        sandbox_new(&s, 0);
        setenv("AOTFUSE_JIT_JOBS", cases[c].jobs, 1);
        char *src = two_unit_source(cases[c].pad, (int)c);
        af_jit_module *m = NULL;
        int calls, parts, links;
        assert_int_equal(af_jit_cpu_load(src, &m, NULL), AF_OK);
        count_calls(&s, &calls, &parts, &links);
        assert_int_equal(calls, 1);
        assert_int_equal(parts, 0);
        check_module(m, (int)c);
        assert_int_equal(leftovers(&s), 0);
        af_jit_module_free(m);
        free(src);
        sandbox_free(&s);
    }
}

/* A compiler that cannot be started: a clear error at once, and only the JIT's own children are
 * waited for (a failed start once made it wait for any child: another thread's compiler, or a
 * long-lived child of the process such as a data loader's worker). */
static void test_a_missing_compiler_waits_for_no_other_child(void **state) {
    (void)state;
    sandbox s;
    sandbox_new(&s, 0);
    setenv("AOTFUSE_CC", "/nonexistent/cc", 1);
    setenv("AOTFUSE_JIT_JOBS", "2", 1);
    pid_t worker = fork();
    assert_true(worker >= 0);
    if (worker == 0) {
        sleep(3);
        _exit(42);
    }
    char *src = two_unit_source(20000, 9);
    af_jit_module *m = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(af_jit_cpu_load(src, &m, NULL), AF_ERR_UNSUPPORTED);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    assert_null(m);
    assert_non_null(strstr(af_error_message(), "C compiler"));
    assert_true((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9 < 2.5); /* not the worker's 3 s */
    int status = 0;
    assert_int_equal(waitpid(worker, &status, 0), worker); /* still ours to reap */
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 42);
    assert_int_equal(leftovers(&s), 0);
    free(src);
    sandbox_free(&s);
}

/* A cached object cut short (its header and its start intact, the rest lost: a crash during a copy
 * of the cache) is rebuilt: dlopen mapped it and the process died of SIGBUS on the missing pages.
 * So is a FIFO at its name (dlopen blocked on it), and a file of zeros. */
static void test_a_truncated_or_odd_cache_entry_is_rebuilt(void **state) {
    (void)state;
    sandbox s;
    sandbox_new(&s, 0);
    setenv("AOTFUSE_JIT_JOBS", "1", 1);
    char *src = two_unit_source(100, 11);
    af_jit_module *m = NULL;
    int hit = -1, calls, parts, links;
    assert_int_equal(af_jit_cpu_load(src, &m, &hit), AF_OK);
    assert_int_equal(hit, 0);
    char path[4200];
    snprintf(path, sizeof path, "%s", af_jit_path(m));
    af_jit_module_free(m); /* unmapped: the file can change under no mapping of this process */
    for (int how = 0; how < 3; how++) {
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        assert_int_equal(fseek(f, 0, SEEK_END), 0);
        long size = ftell(f);
        fclose(f);
        assert_true(size > 4096);
        if (how == 0) {
            assert_int_equal(truncate(path, size / 2), 0);
        } else if (how == 1) {
            assert_int_equal(unlink(path), 0);
            assert_int_equal(mkfifo(path, 0600), 0);
        } else {
            f = fopen(path, "wb");
            assert_non_null(f);
            for (long i = 0; i < size; i++) fputc(0, f);
            assert_int_equal(fclose(f), 0);
        }
        m = NULL;
        hit = -1;
        assert_int_equal(af_jit_cpu_load(src, &m, &hit), AF_OK);
        assert_int_equal(hit, 0);
        check_module(m, 11);
        af_jit_module_free(m);
        count_calls(&s, &calls, &parts, &links);
        assert_int_equal(calls, 2 + how); /* compiled again each time */
    }
    m = NULL;
    assert_int_equal(af_jit_cpu_load(src, &m, &hit), AF_OK);
    assert_int_equal(hit, 1);
    af_jit_module_free(m);
    assert_int_equal(leftovers(&s), 0);
    free(src);
    sandbox_free(&s);
}

/* The OpenMP flag is probed once per compiler, and the source compiled once with it: an error in
 * an OpenMP pragma of the source is the compiler's error (it was retried without OpenMP, where the
 * pragma is ignored, and built on one thread without a word). */
static void test_a_source_error_is_not_retried_without_openmp(void **state) {
    (void)state;
    sandbox s;
    sandbox_new(&s, 0);
    setenv("AOTFUSE_JIT_JOBS", "1", 1);
    const char *bad = "float af_body_0(const float *a) {\n"
                      "  float s = 0.0f;\n"
                      "  #pragma omp simd reduction(+:not_declared_anywhere)\n"
                      "  for (int i = 0; i < 64; i++) s += a[i];\n"
                      "  return s;\n"
                      "}\n";
    af_jit_module *m = NULL;
    int calls, parts, links;
    assert_int_equal(af_jit_cpu_load(bad, &m, NULL), AF_ERR_UNSUPPORTED);
    assert_null(m);
    assert_non_null(strstr(af_error_message(), "not_declared_anywhere"));
    count_calls(&s, &calls, &parts, &links);
    assert_int_equal(calls, 1);
    assert_int_equal(count_probes(&s), 1);
    char *src = two_unit_source(100, 12); /* the flag is known: no second probe */
    assert_int_equal(af_jit_cpu_load(src, &m, NULL), AF_OK);
    check_module(m, 12);
    count_calls(&s, &calls, &parts, &links);
    assert_int_equal(calls, 2);
    assert_int_equal(count_probes(&s), 1);
    assert_int_equal(leftovers(&s), 0);
    af_jit_module_free(m);
    free(src);
    sandbox_free(&s);
}

/* A compiler that refuses the parts: the module is built as one file all the same, and the next
 * large module does not try the parts again (this process's split stays off: the last test). */
static void test_a_failed_split_falls_back_to_one_file(void **state) {
    (void)state;
    sandbox s;
    sandbox_new(&s, 1);
    setenv("AOTFUSE_JIT_JOBS", "2", 1);
    char *src = two_unit_source(20000, 7);
    af_jit_module *m = NULL;
    int calls, parts, links;
    assert_int_equal(af_jit_cpu_load(src, &m, NULL), AF_OK);
    count_calls(&s, &calls, &parts, &links);
    assert_int_equal(parts, 2);
    assert_int_equal(links, 0);
    assert_int_equal(calls, 3); /* the two failed parts, then the whole file */
    check_module(m, 7);
    assert_int_equal(leftovers(&s), 0);
    char *src2 = two_unit_source(20000, 8);
    af_jit_module *m2 = NULL;
    assert_int_equal(af_jit_cpu_load(src2, &m2, NULL), AF_OK);
    count_calls(&s, &calls, &parts, &links);
    assert_int_equal(parts, 2);
    assert_int_equal(calls, 4);
    check_module(m2, 8);
    af_jit_module_free(m2);
    af_jit_module_free(m);
    free(src2);
    free(src);
    sandbox_free(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_large_source_compiles_in_parts),
        cmocka_unit_test(test_one_job_or_a_small_source_compiles_as_one_file),
        cmocka_unit_test(test_a_missing_compiler_waits_for_no_other_child),
        cmocka_unit_test(test_a_truncated_or_odd_cache_entry_is_rebuilt),
        cmocka_unit_test(test_a_source_error_is_not_retried_without_openmp),
        cmocka_unit_test(test_a_failed_split_falls_back_to_one_file), /* last: turns the split off */
    };
    return cmocka_run_group_tests_name("jit_cpu", tests, NULL, NULL);
}
