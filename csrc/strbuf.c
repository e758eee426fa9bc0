/* A growable string (see include/aotfuse/strbuf.h). */
#include "aotfuse/strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "aotfuse/status.h"

void af_strbuf_printf(af_strbuf *sb, const char *fmt, ...) {
    if (sb->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(sb->buf ? sb->buf + sb->len : NULL, sb->buf ? sb->cap - sb->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            sb->failed = 1;
            return;
        }
        if (sb->buf && sb->len + (size_t)n < sb->cap) {
            sb->len += (size_t)n;
            return;
        }
        size_t ncap = sb->cap ? sb->cap * 2 : 256;
        while (ncap <= sb->len + (size_t)n) ncap *= 2;
        char *p = realloc(sb->buf, ncap);
        if (!p) {
            sb->failed = 1;
            return;
        }
        sb->buf = p;
        sb->cap = ncap;
    }
}

int af_strbuf_finish(af_strbuf *sb, char **out) {
    if (sb->failed || !sb->buf) {
        free(sb->buf);
        sb->buf = NULL;
        return af_error_set(AF_ERR_NOMEM, "out of memory building a string");
    }
    *out = sb->buf;
    sb->buf = NULL;
    return AF_OK;
}
