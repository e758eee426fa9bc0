/* JIT for the CPU backend: C source -> shared object -> loaded module, through a disk cache.
 *
 * The cache (AOTFUSE_CACHE_DIR, else $XDG_CACHE_HOME/aotfuse, else ~/.cache/aotfuse) holds one
 * <key>.so per distinct (source, compiler, flags), key = 64-bit FNV-1a of the three. Entries are
 * written to a temporary name and renamed into place, so concurrent processes never see half a
 * file; each object embeds its key, and an entry that fails to load or carries another key is
 * rebuilt. The compiler is AOTFUSE_CC (default "cc"); a missing or failing compiler is an
 * AF_ERR_UNSUPPORTED error carrying the compiler's own message.
 */
#ifndef AOTFUSE_JIT_H
#define AOTFUSE_JIT_H

#include <stddef.h>
#include <stdint.h>

#include "aotfuse/status.h"

typedef struct af_jit_module af_jit_module;

/* Compiles (or finds in the cache) `source` and loads it. *cache_hit says which, when not NULL.
 *
 * A source whose kernels are marked off by AF_C_UNIT_MARK lines (the C codegen's: everything before
 * the first mark is a prelude of static helpers and declarations) may be compiled as several files
 * at once, each the prelude and some of the units, then linked into the one shared object: the
 * units must reach each other only through declarations of non-static functions, and the source's
 * non-static data must all lie in one unit. Up to AOTFUSE_JIT_JOBS compilers run at once (default:
 * the CPUs this process may use, at most 16); 1 compiles every source as one file. A split compile
 * that fails is retried as one file, which gives the compiler's own error. */
#define AF_C_UNIT_MARK "//@af-unit"
int af_jit_cpu_load(const char *source, af_jit_module **out, int *cache_hit);

/* Called when a wait for the compiler is interrupted by a signal (the Python module's: Python's
 * handlers run, so Ctrl-C raises KeyboardInterrupt); nonzero stops the load: the compilers are
 * killed, their files removed, and the load fails with AF_ERR_RUNTIME. NULL (the default) waits on. */
void af_jit_set_interrupt_check(int (*check)(void));

/* A hash of the compiler (AOTFUSE_CC) and the flags af_jit_cpu_load would use now: part of the cache
 * key, and of a kernel template's identity (templates.h). */
uint64_t af_jit_cpu_config(void);

/* A symbol of a loaded module, or NULL. */
void *af_jit_symbol(af_jit_module *m, const char *name);

/* Where the module's shared object lives (for logs). */
const char *af_jit_path(const af_jit_module *m);

/* Modules are reference counted (a program holds its own and those whose bodies it calls,
 * templates.h): free drops one reference and unloads at the last; NULL allowed. */
void af_jit_module_free(af_jit_module *m);
/* Adds a reference; the caller holds af_tmpl_lock (templates.h). */
void af_jit_module_retain_locked(af_jit_module *m);

/* Shared with the CUDA JIT: the cache folder (created if missing) and the key hash (64-bit
 * FNV-1a, chained: h = af_jit_hash(h, part), starting from 14695981039346656037). */
int af_jit_cache_dir(char *out, size_t n);
uint64_t af_jit_hash(uint64_t h, const char *s);

#endif
