/* A growable string for printers and code generators. Errors are sticky: after a failed
 * allocation every append is a no-op and af_strbuf_finish reports AF_ERR_NOMEM. */
#ifndef AOTFUSE_STRBUF_H
#define AOTFUSE_STRBUF_H

#include <stddef.h>

typedef struct {
    char *buf;
    size_t len, cap;
    int failed;
} af_strbuf;

void af_strbuf_printf(af_strbuf *sb, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Hands the text to *out (the caller frees it) or frees it and returns AF_ERR_NOMEM. */
int af_strbuf_finish(af_strbuf *sb, char **out);

#endif
