/* Kernel templates (see include/aotfuse/templates.h). */
#include "aotfuse/templates.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    char *key;
    uint64_t hash, config; /* config: the compiler and flags it was built with (af_jit_cpu_config) */
    int32_t n_lits, n_lifted;
    int64_t *base;   /* the literals' values in the text */
    uint8_t *lift;   /* per literal: read from af_n */
    const af_jit_module *module;
    af_body_fn fn;
    struct entry *next;
} entry;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static entry *entries; /* newest first */
static int32_t n_entries;

void af_tmpl_lock(void) { pthread_mutex_lock(&lock); }
void af_tmpl_unlock(void) { pthread_mutex_unlock(&lock); }

static void entry_free(entry *e) {
    free(e->key);
    free(e->base);
    free(e->lift);
    free(e);
}

void af_tmpl_forget_locked(const af_jit_module *m) {
    for (entry **at = &entries; *at;) {
        entry *e = *at;
        if (e->module != m) {
            at = &e->next;
            continue;
        }
        *at = e->next;
        entry_free(e);
        n_entries--;
    }
}

static int same_body(const entry *e, const af_cg_shared *b, uint64_t config) {
    return e->hash == b->hash && e->config == config && e->n_lits == b->n_lits && !strcmp(e->key, b->key);
}

/* A literal's C type: int, or a 64-bit integer past INT_MAX. */
static int wide(int64_t v) { return v > INT32_MAX; }

/* A value a lifted literal may take: a size (> 1; a unit stride or size stays a constant) of the type
 * the entry's literal had. */
static int fits(int64_t was, int64_t now) { return now > 1 && wide(was) == wide(now); }

static int matches(const entry *e, const af_cg_shared *b) {
    for (int32_t j = 0; j < b->n_lits; j++)
        if (e->lift[j] ? !fits(e->base[j], b->lits[j]) : e->base[j] != b->lits[j]) return 0;
    return 1;
}

int af_tmpl_find(const af_cg_shared *b, af_body_fn *fn, af_jit_module **module, uint8_t *lift, int *found) {
    if (!b || !fn || !module || !found || (b->n_lits && !lift)) return af_error_set(AF_ERR_INVALID, "af_tmpl_find: NULL argument");
    *found = 0;
    if (b->n_lits) memset(lift, 0, (size_t)b->n_lits);
    uint64_t config = af_jit_cpu_config();
    af_tmpl_lock();
    const entry *general = NULL;
    for (const entry *e = entries; e; e = e->next) {
        if (!same_body(e, b, config)) continue;
        if (matches(e, b)) {
            af_jit_module_retain_locked((af_jit_module *)e->module);
            *fn = e->fn;
            *module = (af_jit_module *)e->module;
            *found = 1;
            af_tmpl_unlock();
            return AF_OK;
        }
        if (!general || e->n_lifted > general->n_lifted) general = e;
    }
    /* a template: what the most general entry lifts, and what differs from it, where both values
     * are sizes (> 1) of one C type */
    for (int32_t j = 0; general && j < b->n_lits; j++) {
        int64_t was = general->base[j], now = b->lits[j];
        lift[j] = (general->lift[j] || (was != now && was > 1)) && fits(was, now);
    }
    af_tmpl_unlock();
    return AF_OK;
}

int af_tmpl_add(const af_cg_shared *b, const uint8_t *lift, af_jit_module *m, af_body_fn fn) {
    if (!b || !m || !fn) return af_error_set(AF_ERR_INVALID, "af_tmpl_add: NULL argument");
    entry *e = calloc(1, sizeof *e);
    size_t n = (size_t)b->n_lits, key_len = strlen(b->key) + 1;
    if (!e || !(e->key = malloc(key_len)) || !(e->base = malloc((n ? n : 1) * sizeof *e->base)) || !(e->lift = calloc(n ? n : 1, 1))) {
        if (e) entry_free(e);
        return af_error_set(AF_ERR_NOMEM, "out of memory registering a kernel");
    }
    memcpy(e->key, b->key, key_len);
    e->hash = b->hash;
    e->config = af_jit_cpu_config();
    e->n_lits = b->n_lits;
    if (n) memcpy(e->base, b->lits, n * sizeof *e->base);
    for (int32_t j = 0; lift && j < b->n_lits; j++) e->n_lifted += (e->lift[j] = lift[j] != 0);
    e->module = m;
    e->fn = fn;
    af_tmpl_lock();
    e->next = entries;
    entries = e;
    n_entries++;
    af_tmpl_unlock();
    return AF_OK;
}

int32_t af_tmpl_count(void) {
    af_tmpl_lock();
    int32_t n = n_entries;
    af_tmpl_unlock();
    return n;
}
