/* CMocka tests of csrc/hugepages.c: which bytes of a buffer are marked (the whole 2 MiB pages
 * inside it), and on Linux that the kernel records the mark on exactly that range. */
#define _DEFAULT_SOURCE /* mmap's MAP_ANONYMOUS */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "aotfuse/hugepages.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#define MIB ((int64_t)1 << 20)

static void test_span_is_the_whole_huge_pages_inside(void **state) {
    (void)state;
    char *base = (char *)(uintptr_t)(64 * MIB); /* never dereferenced: address arithmetic only */
    assert_int_equal(af_huge_pages_span(NULL, 64 * MIB), 0);
    assert_int_equal(af_huge_pages_span(base, 0), 0);
    assert_int_equal(af_huge_pages_span(base, -5), 0);
    assert_int_equal(af_huge_pages_span(base, 2 * MIB - 1), 0);
    assert_int_equal(af_huge_pages_span(base, 2 * MIB), 2 * MIB);       /* aligned: all of it */
    assert_int_equal(af_huge_pages_span(base, 5 * MIB), 4 * MIB);       /* the tail's part page left out */
    assert_int_equal(af_huge_pages_span(base + 4096, 4 * MIB), 2 * MIB); /* both ends part pages */
    assert_int_equal(af_huge_pages_span(base + 4096, 2 * MIB), 0);      /* straddles two pages, holds none */
    assert_int_equal(af_huge_pages_span((void *)(UINTPTR_MAX - MIB), 8 * MIB), 0); /* wraps */
}

#if defined(__linux__)
/* Whether the mapping holding addr carries VmFlags token `flag` (/proc/self/smaps); -1 when no
 * mapping holds it or smaps cannot be read. */
static int vm_flag(uintptr_t addr, const char *flag) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int inside = 0, found = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') && line[0] != 'V') {
            inside = lo <= addr && addr < hi;
        } else if (inside && strncmp(line, "VmFlags:", 8) == 0) {
            char needle[16];
            snprintf(needle, sizeof needle, " %s", flag);
            found = strstr(line, needle) != NULL;
            break;
        }
    }
    fclose(f);
    return found;
}
#endif

static void test_advice_marks_exactly_the_span(void **state) {
    (void)state;
#if defined(__linux__)
    int64_t len = 12 * MIB;
    char *m = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(m != MAP_FAILED);
    char *buf = m + 4096; /* not 2 MiB aligned: the leading part page stays unmarked */
    int64_t want = af_huge_pages_span(buf, 8 * MIB), got = af_advise_huge_pages(buf, 8 * MIB);
    assert_true(want >= 6 * MIB);
    if (got == 0) {
        /* a kernel without transparent huge pages refuses the advice: nothing to check beyond no crash */
        assert_int_equal(access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0 ? 1 : 0, 0);
    } else {
        assert_int_equal(got, want);
        uintptr_t first = ((uintptr_t)buf + (uintptr_t)(2 * MIB) - 1) & ~(uintptr_t)(2 * MIB - 1);
        assert_int_equal(vm_flag(first, "hg"), 1);
        assert_int_equal(vm_flag(first + (uintptr_t)want - 1, "hg"), 1);
        assert_int_equal(vm_flag((uintptr_t)buf, "hg"), 0);               /* before the span */
        assert_int_equal(vm_flag(first + (uintptr_t)want, "hg"), 0);      /* after it */
        memset(buf, 1, (size_t)(8 * MIB)); /* still ordinary memory */
        assert_int_equal(buf[8 * MIB - 1], 1);
    }
    assert_int_equal(af_advise_huge_pages(buf, MIB), 0); /* too small: no call */
    munmap(m, (size_t)len);
#else
    skip();
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_span_is_the_whole_huge_pages_inside),
        cmocka_unit_test(test_advice_marks_exactly_the_span),
    };
    return cmocka_run_group_tests_name("hugepages", tests, NULL, NULL);
}
