/* Helpers the CMocka tests share (each test file is its own program). */
#ifndef AOTFUSE_TEST_UTIL_H
#define AOTFUSE_TEST_UTIL_H

#include <stdint.h>
#include <string.h>

#include "aotfuse/ir.h"

/* A float32 CPU tensor's metadata over the caller's sizes and strides (nd of each). */
static inline af_tensor_meta f32_cpu_meta(int32_t nd, const int64_t *sizes, const int64_t *strides) {
    af_tensor_meta m = {0};
    m.type = AF_VALUE_TENSOR;
    m.dtype = AF_DTYPE_FLOAT32;
    m.device.type = AF_DEVICE_CPU;
    m.device.index = -1;
    m.ndim = nd;
    m.sizes = sizes;
    m.strides = strides;
    return m;
}

/* How many times needle occurs in text (overlapping occurrences counted). */
static inline int count_of(const char *text, const char *needle) {
    int n = 0;
    for (const char *at = strstr(text, needle); at; at = strstr(at + 1, needle)) n++;
    return n;
}

#endif
