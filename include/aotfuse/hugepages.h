/* Transparent huge pages for large CPU buffers.
 *
 * A fresh CPU tensor of 32 MiB or more comes from its own mmap (glibc's dynamic mmap threshold
 * stops rising at 32 MiB), so its first writes fault in every 4 KiB page: writing a fresh
 * 1024 x 8192 float32 tensor took 8.9 ms where writing the same values into an existing one took
 * 2.4 ms. Marked MADV_HUGEPAGE before that first touch, the range faults in 2 MiB pages (4.0 ms),
 * where the system's transparent huge pages are "madvise" (a common default) or "always". */
#ifndef AOTFUSE_HUGEPAGES_H
#define AOTFUSE_HUGEPAGES_H

#include <stdint.h>

#define AF_HUGE_PAGE_BYTES ((int64_t)2 << 20)

/* Bytes of [ptr, ptr + nbytes) that af_advise_huge_pages would mark: the whole 2 MiB pages inside
 * it (0 when there is none). */
int64_t af_huge_pages_span(const void *ptr, int64_t nbytes);

/* Marks those whole 2 MiB pages MADV_HUGEPAGE. Returns the bytes marked: 0 when there are none,
 * on a system without transparent huge pages (non-Linux, or madvise refusing), never an error:
 * the memory is as usable either way. */
int64_t af_advise_huge_pages(void *ptr, int64_t nbytes);

#endif
