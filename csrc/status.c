/* Per-thread error message: the C core never prints and never aborts on user input. */
#include "aotfuse/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char af_error_buf[1024];

int af_error_set(int status, const char *fmt, ...) {
    /* Formats into a local buffer first: callers may pass af_error_message() itself as an
     * argument to prefix the previous message ("node x: <inner error>"). */
    char tmp[sizeof af_error_buf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(af_error_buf, tmp, sizeof tmp);
    return status;
}

const char *af_error_message(void) { return af_error_buf; }

void af_error_clear(void) { af_error_buf[0] = '\0'; }

const char *af_status_name(int status) {
    switch (status) {
    case AF_OK: return "AF_OK";
    case AF_ERR_NOMEM: return "AF_ERR_NOMEM";
    case AF_ERR_INVALID: return "AF_ERR_INVALID";
    case AF_ERR_UNSUPPORTED: return "AF_ERR_UNSUPPORTED";
    case AF_ERR_RUNTIME: return "AF_ERR_RUNTIME";
    case AF_ERR_BRIDGE: return "AF_ERR_BRIDGE";
    default: return "AF_ERR_UNKNOWN";
    }
}
