/* Transparent huge pages for large CPU buffers (hugepages.h). */
#if defined(__linux__)
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include <sys/mman.h>
#endif
#include "aotfuse/hugepages.h"

#include <stddef.h>

int64_t af_huge_pages_span(const void *ptr, int64_t nbytes) {
    if (!ptr || nbytes < AF_HUGE_PAGE_BYTES) return 0;
    uintptr_t page = (uintptr_t)AF_HUGE_PAGE_BYTES, lo = (uintptr_t)ptr, hi = lo + (uintptr_t)nbytes;
    if (hi < lo) return 0; /* wraps: not a real buffer */
    uintptr_t first = (lo + page - 1) & ~(page - 1), last = hi & ~(page - 1);
    return last > first ? (int64_t)(last - first) : 0;
}

int64_t af_advise_huge_pages(void *ptr, int64_t nbytes) {
    int64_t span = af_huge_pages_span(ptr, nbytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (span > 0) {
        uintptr_t page = (uintptr_t)AF_HUGE_PAGE_BYTES, first = ((uintptr_t)ptr + page - 1) & ~(page - 1);
        if (madvise((void *)first, (size_t)span, MADV_HUGEPAGE) != 0) return 0;
    }
    return span;
#else
    (void)span;
    return 0;
#endif
}
