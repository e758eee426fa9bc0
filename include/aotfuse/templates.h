/* Kernel templates: C kernel bodies of loaded modules that later programs call instead of
 * compiling their own (a new input shape of a model compiles nothing the earlier shapes' kernels
 * already cover).
 *
 * Every body a program compiles is registered with its key and literal values (af_cg_shared). A
 * later body with the same key is found when each of its literals is either one the registered
 * body reads from af_n (any value of the same C type) or equal to the registered value: the
 * program then calls the registered body with its own values. A body with a registered key that
 * matches no entry is compiled as a template: the literals that differ from the most general
 * entry's (and those it lifts) are read from af_n, so the next shape that varies the same sizes
 * finds it. Values 0 and 1 stay in the text (a unit stride or size is what lets the compiler
 * vectorize): a lifted literal takes sizes > 1 only. An entry also holds the compiler and flags it
 * was built with (af_jit_cpu_config): other settings find nothing. Entries are weak: a module's
 * leave with it (af_jit_module_free). Thread-safe.
 *
 * A found or lifted body computes the same function as the program's own text, but a reduction
 * whose length is an argument may add its terms in another order than the one with the length as
 * a constant (the vectorizer's loop structure): the same shape's sums can differ in the last bits
 * depending on which shapes a process compiled first. Under torch.use_deterministic_algorithms the
 * lowering turns templates off (lower.py).
 */
#ifndef AOTFUSE_TEMPLATES_H
#define AOTFUSE_TEMPLATES_H

#include <stdint.h>

#include "aotfuse/codegen.h"
#include "aotfuse/jit.h"

/* Looks for a registered body computing b. Found (*found = 1): *fn, and *module retained for the
 * caller (who releases it with af_jit_module_free). Not found: lift (b->n_lits flags) says which
 * of b's literals the body the caller compiles should read from af_n. */
int af_tmpl_find(const af_cg_shared *b, af_body_fn *fn, af_jit_module **module, uint8_t *lift, int *found);
/* Registers fn, loaded from m, as computing b with the literals flagged in lift (NULL: none) read from af_n. */
int af_tmpl_add(const af_cg_shared *b, const uint8_t *lift, af_jit_module *m, af_body_fn fn);
/* Registered bodies (for tests and logs). */
int32_t af_tmpl_count(void);

/* For the JIT: module reference counts change under this lock; af_tmpl_forget_locked drops a
 * dying module's entries. */
void af_tmpl_lock(void);
void af_tmpl_unlock(void);
void af_tmpl_forget_locked(const af_jit_module *m);

#endif
