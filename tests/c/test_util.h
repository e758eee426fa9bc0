/* Helpers the CMocka tests share (each test file is its own program). */
#ifndef AOTFUSE_TEST_UTIL_H
#define AOTFUSE_TEST_UTIL_H

#include <string.h>

/* How many times needle occurs in text (overlapping occurrences counted). */
static inline int count_of(const char *text, const char *needle) {
    int n = 0;
    for (const char *at = strstr(text, needle); at; at = strstr(at + 1, needle)) n++;
    return n;
}

#endif
