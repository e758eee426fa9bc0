/* aotfuse status codes and the per-thread error message.
 *
 * Every fallible C function returns an int status: AF_OK (0) or a negative AF_ERR_*.
 * The function that fails first writes a message with af_error_set(); callers pass the
 * status up unchanged. module.c alone turns a status into a Python exception.
 */
#ifndef AOTFUSE_STATUS_H
#define AOTFUSE_STATUS_H

#include <stddef.h>

enum {
    AF_OK = 0,
    AF_ERR_NOMEM = -1,       /* an allocation failed */
    AF_ERR_INVALID = -2,     /* malformed input: a graph, an argument, a value id */
    AF_ERR_UNSUPPORTED = -3, /* well-formed but not handled (an op, a dtype) */
    AF_ERR_RUNTIME = -4,     /* a step failed while running (an extern raised, a bad input) */
    AF_ERR_BRIDGE = -5       /* torch could not be reached */
};

/* Formats the message of the current thread's last error; returns `status` so that
 * `return af_error_set(AF_ERR_INVALID, "...")` reads as one step. */
int af_error_set(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* The current thread's last error message ("" if none). Valid until the next af_error_set. */
const char *af_error_message(void);

/* Clears the current thread's message. */
void af_error_clear(void);

/* The name of a status code ("AF_ERR_INVALID", ...). */
const char *af_status_name(int status);

#endif
