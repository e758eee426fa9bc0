/* CMocka tests of csrc/maxflow.c: max-flow value equals a brute-force minimum cut on
 * hundreds of random small networks, and the reported source side is such a cut. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "aotfuse/maxflow.h"

typedef struct {
    int32_t from, to;
    int64_t cap;
} edge;

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) { /* xorshift64*: reproducible across runs */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

static int64_t sat_add(int64_t a, int64_t b) { return (b >= AF_FLOW_INF - a) ? AF_FLOW_INF : a + b; }

/* capacity of the cut where bit v of mask says v is on the source side */
static int64_t cut_of(const edge *es, int m, uint32_t mask) {
    int64_t c = 0;
    for (int i = 0; i < m; i++)
        if (((mask >> es[i].from) & 1) && !((mask >> es[i].to) & 1)) c = sat_add(c, es[i].cap);
    return c;
}

static int64_t brute_min_cut(const edge *es, int m, int n, int s, int t) {
    int64_t best = AF_FLOW_INF;
    for (uint32_t mask = 0; mask < (1u << n); mask++) {
        if (!((mask >> s) & 1) || ((mask >> t) & 1)) continue;
        int64_t c = cut_of(es, m, mask);
        if (c < best) best = c;
    }
    return best;
}

static void test_random_networks_match_brute_force(void **state) {
    (void)state;
    for (int trial = 0; trial < 600; trial++) {
        int n = 2 + (int)(rnd() % 9); /* 2..10 vertices */
        int m = (int)(rnd() % (3 * n + 1));
        edge es[64];
        for (int i = 0; i < m; i++) {
            es[i].from = (int32_t)(rnd() % (uint64_t)n);
            es[i].to = (int32_t)(rnd() % (uint64_t)n);
            uint64_t r = rnd() % 10;
            es[i].cap = r == 0 ? AF_FLOW_INF : r == 1 ? 0 : (int64_t)(rnd() % 1000000007ull);
        }
        int s = (int)(rnd() % (uint64_t)n), t = (int)(rnd() % (uint64_t)n);
        if (s == t) t = (s + 1) % n;
        af_flow *f = NULL;
        assert_int_equal(af_flow_new(n, &f), AF_OK);
        for (int i = 0; i < m; i++) assert_int_equal(af_flow_add_edge(f, es[i].from, es[i].to, es[i].cap), AF_OK);
        int64_t value = -1;
        assert_int_equal(af_flow_solve(f, s, t, &value), AF_OK);
        int64_t expect = brute_min_cut(es, m, n, s, t);
        assert_int_equal(value, expect);
        uint8_t side[16];
        assert_int_equal(af_flow_source_side(f, side), AF_OK);
        assert_int_equal(side[s], 1);
        if (value < AF_FLOW_INF) {
            assert_int_equal(side[t], 0);
            uint32_t mask = 0;
            for (int v = 0; v < n; v++) mask |= (uint32_t)side[v] << v;
            assert_int_equal(cut_of(es, m, mask), value); /* the reported side is a minimum cut */
        }
        af_flow_free(f);
    }
}

static void test_layered_chain_is_fast_and_right(void **state) {
    (void)state;
    /* a 20000-vertex chain of split vertices, like the partitioner's: cut at the lightest */
    int32_t n = 20002, s = 20000, t = 20001;
    af_flow *f = NULL;
    assert_int_equal(af_flow_new(n, &f), AF_OK);
    assert_int_equal(af_flow_add_edge(f, s, 0, AF_FLOW_INF), AF_OK);
    for (int32_t v = 0; v + 1 < 20000; v++)
        assert_int_equal(af_flow_add_edge(f, v, v + 1, v == 12345 ? 7 : 1000 + v % 17), AF_OK);
    assert_int_equal(af_flow_add_edge(f, 19999, t, AF_FLOW_INF), AF_OK);
    int64_t value;
    assert_int_equal(af_flow_solve(f, s, t, &value), AF_OK);
    assert_int_equal(value, 7);
    uint8_t *side = malloc((size_t)n);
    assert_non_null(side);
    assert_int_equal(af_flow_source_side(f, side), AF_OK);
    assert_int_equal(side[12345], 1);
    assert_int_equal(side[12346], 0);
    free(side);
    af_flow_free(f);
}

static void test_infinite_path_and_errors(void **state) {
    (void)state;
    af_flow *f = NULL;
    assert_int_equal(af_flow_new(1, &f), AF_ERR_INVALID);
    assert_int_equal(af_flow_new(3, &f), AF_OK);
    assert_int_equal(af_flow_add_edge(f, 0, 1, AF_FLOW_INF), AF_OK);
    assert_int_equal(af_flow_add_edge(f, 1, 2, INT64_MAX), AF_OK); /* clamped to infinite */
    assert_int_equal(af_flow_add_edge(f, 0, 3, 1), AF_ERR_INVALID);
    assert_int_equal(af_flow_add_edge(f, 0, 1, -1), AF_ERR_INVALID);
    uint8_t side[3];
    assert_int_equal(af_flow_source_side(f, side), AF_ERR_INVALID); /* before solve */
    int64_t value;
    assert_int_equal(af_flow_solve(f, 0, 0, &value), AF_ERR_INVALID);
    assert_int_equal(af_flow_solve(f, 0, 2, &value), AF_OK);
    assert_int_equal(value, AF_FLOW_INF);
    assert_int_equal(af_flow_solve(f, 0, 2, &value), AF_ERR_INVALID); /* once */
    assert_int_equal(af_flow_add_edge(f, 0, 2, 1), AF_ERR_INVALID);    /* after solve */
    assert_int_equal(af_flow_num_vertices(f), 3);
    assert_int_equal(af_flow_num_edges(f), 2);
    af_flow_free(f);
    af_flow_free(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_networks_match_brute_force),
        cmocka_unit_test(test_layered_chain_is_fast_and_right),
        cmocka_unit_test(test_infinite_path_and_errors),
    };
    return cmocka_run_group_tests_name("maxflow", tests, NULL, NULL);
}
