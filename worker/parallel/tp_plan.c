#include "parallel/tp_plan.h"

#include <stdio.h>
#include <string.h>

#include "parallel/lora.h"

static void site(const dit_tp_plan *tp, const char *module, int64_t N, int64_t K, dit_linear *L,
                 int64_t row0, int64_t n0, int64_t nl, int64_t k0, int64_t kl)
{
    if (tp->sites)
        dit_lora_sites_add(tp->sites, module, N, K, L, row0, n0, nl, k0, kl);
}

bool dit_tp_pattern_match(const char *pat, const char *s)
{
    while (*pat && *s) {
        if (*pat == '*') {
            while (*s && *s != '.')
                s++;
            pat++;
            continue;
        }
        if (*pat != *s)
            return false;
        pat++;
        s++;
    }
    return *pat == '\0' && *s == '\0';
}

dit_tp_style dit_tp_plan_style(const dit_tp_plan *tp, const char *module)
{
    for (int i = 0; i < tp->n_rules; i++)
        if (dit_tp_pattern_match(tp->rules[i].pattern, module))
            return tp->rules[i].style;
    return DIT_TP_REPLICATE;
}

/* Rows [r0, r0 + n) of name.weight (N_full, K) and of its bias into rows
 * [row0, row0 + n) of L (already reserved). */
static void rows_into(dit_weight_plan *p, dit_linear *L, const char *name, int64_t N_full,
                      int64_t K, int64_t r0, int64_t n, int64_t row0)
{
    char buf[192];
    snprintf(buf, sizeof buf, "%s.weight", name);
    dit_weight_piece *w = dit_weight_plan_piece(p, buf, 2, N_full, K);
    if (w) {
        w->r0 = r0;
        w->nr = n;
        w->dst = &L->w;
        w->dst_row0 = row0;
    }
    snprintf(buf, sizeof buf, "%s.bias", name);
    w = dit_weight_plan_piece(p, buf, 1, N_full, 0);
    if (w) {
        w->r0 = r0;
        w->nr = n;
        w->dst = &L->b;
        w->dst_row0 = row0;
    }
}

/* Columns [c0, c0 + nc) of name.weight (N, K_full) into L->w (N, nc). The
 * bias is added once, by the rank told to; the others still check it.
 * take_bias < 0 leaves the bias to another piece. */
static void cols(dit_weight_plan *p, dit_linear *L, const char *name, int64_t N, int64_t K_full,
                 int64_t c0, int64_t nc, int take_bias)
{
    char buf[192];
    dit_weight_plan_tensor(p, &L->w, p->mat_dtype, 2, N, nc);
    snprintf(buf, sizeof buf, "%s.weight", name);
    dit_weight_piece *w = dit_weight_plan_piece(p, buf, 2, N, K_full);
    if (w) {
        w->c0 = c0;
        w->nc = nc;
        w->dst = &L->w;
    }
    L->has_b = false;
    if (take_bias < 0)
        return;
    snprintf(buf, sizeof buf, "%s.bias", name);
    w = dit_weight_plan_piece(p, buf, 1, N, 0);
    if (!w)
        return;
    if (take_bias) {
        dit_weight_plan_tensor(p, &L->b, DIT_F32, 1, N, 0);
        L->has_b = true;
        w->dst = &L->b;
    }
}

static void reserve(dit_weight_plan *p, dit_linear *L, int64_t N, int64_t K)
{
    dit_weight_plan_tensor(p, &L->w, p->mat_dtype, 2, N, K);
    dit_weight_plan_tensor(p, &L->b, DIT_F32, 1, N, 0);
    L->has_b = true;
}

static void mark_bad(dit_weight_plan *p, const char *module, const char *why)
{
    if (!p->bad)
        snprintf(p->bad_msg, sizeof p->bad_msg, "tensor-parallel plan: '%s' %s", module, why);
    p->bad = true;
}

void dit_tp_add_linear(dit_weight_plan *wp, const dit_tp_plan *tp, const char *module, int64_t N,
                       int64_t K, dit_linear *L)
{
    const int T = tp->tp_degree, r = tp->tp_rank;
    switch (dit_tp_plan_style(tp, module)) {
    case DIT_TP_REPLICATE: {
        char buf[192];
        reserve(wp, L, N, K);
        snprintf(buf, sizeof buf, "%s.weight", module);
        dit_weight_piece *w = dit_weight_plan_piece(wp, buf, 2, N, K);
        if (w)
            w->dst = &L->w;
        snprintf(buf, sizeof buf, "%s.bias", module);
        w = dit_weight_plan_piece(wp, buf, 1, N, 0);
        if (w)
            w->dst = &L->b;
        site(tp, module, N, K, L, 0, 0, N, 0, K);
        return;
    }
    case DIT_TP_COLWISE:
    case DIT_TP_COLWISE_GATHER:
        reserve(wp, L, N / T, K);
        rows_into(wp, L, module, N, K, r * (N / T), N / T, 0);
        site(tp, module, N, K, L, 0, r * (N / T), N / T, 0, K);
        return;
    case DIT_TP_ROWWISE:
        cols(wp, L, module, N, K, r * (K / T), K / T, r == 0);
        site(tp, module, N, K, L, 0, 0, N, r * (K / T), K / T);
        return;
    case DIT_TP_PACKED_ROWS:
        mark_bad(wp, module, "is PACKED_ROWS; its model must load it with dit_tp_add_packed");
        return;
    }
}

void dit_tp_add_fused(dit_weight_plan *wp, const dit_tp_plan *tp, const char *const *modules,
                      const int64_t *N, int n_modules, int64_t K, dit_linear *L)
{
    const int T = tp->tp_degree, r = tp->tp_rank;
    int64_t rows = 0;
    for (int i = 0; i < n_modules; i++)
        rows += N[i] / T;
    reserve(wp, L, rows, K);
    int64_t row0 = 0;
    for (int i = 0; i < n_modules; i++) {
        const dit_tp_style st = dit_tp_plan_style(tp, modules[i]);
        if (st != DIT_TP_COLWISE && !(st == DIT_TP_REPLICATE && T == 1))
            mark_bad(wp, modules[i], "is fused into a column-split projection but not COLWISE");
        rows_into(wp, L, modules[i], N[i], K, r * (N[i] / T), N[i] / T, row0);
        site(tp, modules[i], N[i], K, L, row0, r * (N[i] / T), N[i] / T, 0, K);
        row0 += N[i] / T;
    }
}

void dit_tp_add_packed(dit_weight_plan *wp, const dit_tp_plan *tp, const char *module, int64_t N,
                       const int64_t *widths, int n_blocks, dit_linear *const *L)
{
    const int T = tp->tp_degree, r = tp->tp_rank;
    if (dit_tp_plan_style(tp, module) != DIT_TP_PACKED_ROWS)
        mark_bad(wp, module, "is loaded as packed blocks but not PACKED_ROWS");
    int64_t K = 0;
    for (int i = 0; i < n_blocks; i++)
        K += widths[i];
    int64_t start = 0;
    for (int i = 0; i < n_blocks; i++) {
        const int64_t local = widths[i] / T;
        cols(wp, L[i], module, N, K, start + r * local, local, i == 0 ? r == 0 : -1);
        site(tp, module, N, K, L[i], 0, 0, N, start + r * local, local);
        start += widths[i];
    }
}
