/* JIT for the CUDA backend: CUDA C -> NVRTC -> cubin (or PTX) -> a module loaded by the driver.
 *
 * libcuda and libnvrtc are opened at run time (dlopen), so the package builds and imports on
 * machines without CUDA; NVRTC alone (no GPU, no driver) is enough to compile, which is how CI
 * checks the generated CUDA. NVRTC is looked up as $AOTFUSE_NVRTC, then libnvrtc.so.{13,12} on
 * the loader's path, then in the folders given to af_cuda_add_search_dir (torch's and the
 * nvidia-cuda-nvrtc wheel's library folders, CUDA_HOME/lib64).
 *
 * Compiled images share the CPU backend's cache folder: <key>.cubin, key = FNV-1a of the
 * source, the target architecture and NVRTC's version; a header carries the key and length,
 * so a truncated or foreign file is rebuilt, never loaded. An architecture NVRTC cannot emit
 * machine code for gets PTX for the newest one it can, which the driver compiles at load.
 *
 * Kernels are launched on a stream the caller gives (torch's current stream), in the device's
 * primary context, which is torch's. Every driver and NVRTC call is checked; errors carry the
 * call, CUDA's message, and the compile log.
 */
#ifndef AOTFUSE_JIT_CUDA_H
#define AOTFUSE_JIT_CUDA_H

#include <stddef.h>

#include "aotfuse/status.h"

typedef struct af_cuda_module af_cuda_module;

/* Adds a folder to search for libnvrtc (before the first use). */
int af_cuda_add_search_dir(const char *dir);

/* Loads NVRTC (need_driver = 0) or NVRTC and the driver, initialized (need_driver = 1).
 * AF_ERR_UNSUPPORTED with the reason when one is missing. Idempotent. */
int af_cuda_load(int need_driver);

/* Where NVRTC was loaded from, and its version (after a successful af_cuda_load). */
const char *af_nvrtc_path(void);
int af_nvrtc_version(void); /* major * 1000 + minor * 10 */

/* Compiles source with NVRTC for compute capability `arch` (90 for sm_90): a cubin, or PTX
 * when ptx is set. verbose asks ptxas for its registers/spills report, which lands in *log
 * (malloc'd, may be NULL). *image (malloc'd) and *size are the result. On a compile error the
 * status is AF_ERR_UNSUPPORTED and the message holds the start of the log. */
int af_nvrtc_compile(const char *source, int arch, int ptx, int verbose, char **image, size_t *size, char **log);

/* Facts of CUDA device `device` (after af_cuda_load(1)). */
int af_cuda_device_info(int device, int *arch, int *sm_count);

/* Compiles (or finds in the cache) source for `device` and loads it there. */
int af_cuda_module_load(const char *source, int device, af_cuda_module **out, int *cache_hit);

/* A kernel of the module (NULL with an error when missing). */
int af_cuda_function(af_cuda_module *m, const char *name, void **fn);

/* Launches fn on (grid_x, grid_y) blocks of `threads` on `stream`, in the module's device's
 * context; params: one pointer per kernel argument, to the argument's value. */
int af_cuda_launch_kernel(const af_cuda_module *m, void *fn, unsigned grid_x, unsigned grid_y, unsigned threads, void *stream,
                   void **params);

/* Registers and local-memory bytes of a kernel (for reports). */
int af_cuda_function_registers(void *fn, int *registers, int *local_bytes);

void af_cuda_module_free(af_cuda_module *m); /* NULL allowed */

#endif
