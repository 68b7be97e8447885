#include "schedulers/unipc.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/json_util.h"

static dit_status refuse(dit_diag *diag, const char *path, const char *key, const char *why)
{
    return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                        "%s: UniPCMultistepScheduler with %s is not supported (%s)", path, key,
                        why);
}

dit_status dit_unipc_config_load(const char *path, dit_unipc_config *out, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    dit_unipc_config c;
    memset(&c, 0, sizeof c);
    int64_t v;
    bool flag;
    const char *str = NULL;
    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &str, diag));
    if (str && strcmp(str, "UniPCMultistepScheduler") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: scheduler \"%s\" is not supported (UniPCMultistepScheduler is)",
                          path, str);
        goto cleanup;
    }
    DIT_CHECK(
        dit_json_get_int(root, "num_train_timesteps", path, false, 1000, 1, 1000000, &v, diag));
    c.num_train_timesteps = (int)v;
    DIT_CHECK(dit_json_get_int(root, "solver_order", path, false, 2, 1, INT32_MAX, &v, diag));
    if (v > DIT_UNIPC_MAX_ORDER) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: UniPCMultistepScheduler with solver_order %lld is not supported "
                          "(1 to %d are)",
                          path, (long long)v, DIT_UNIPC_MAX_ORDER);
        goto cleanup;
    }
    c.solver_order = (int)v;
    DIT_CHECK(dit_json_get_string(root, "prediction_type", path, false, &str, diag));
    if (!str || strcmp(str, "flow_prediction") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: UniPCMultistepScheduler with prediction_type \"%s\" is not "
                          "supported (\"flow_prediction\" is)",
                          path, str ? str : "epsilon");
        goto cleanup;
    }
    DIT_CHECK(dit_json_get_bool(root, "use_flow_sigmas", path, false, false, &flag, diag));
    if (!flag) {
        st = refuse(diag, path, "use_flow_sigmas false", "flow sigmas only");
        goto cleanup;
    }
    DIT_CHECK(dit_json_get_bool(root, "predict_x0", path, false, true, &flag, diag));
    if (!flag) {
        st = refuse(diag, path, "predict_x0 false", "diffusers refuses it with flow_prediction");
        goto cleanup;
    }
    static const char *const off[] = {"thresholding", "use_karras_sigmas", "use_exponential_sigmas",
                                      "use_beta_sigmas", "use_dynamic_shifting"};
    for (size_t i = 0; i < sizeof off / sizeof *off; i++) {
        DIT_CHECK(dit_json_get_bool(root, off[i], path, false, false, &flag, diag));
        if (flag) {
            char key[64];
            snprintf(key, sizeof key, "%s true", off[i]);
            st = refuse(diag, path, key, "not implemented");
            goto cleanup;
        }
    }
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, "solver_p");
    if (item && !cJSON_IsNull(item)) {
        st = refuse(diag, path, "solver_p", "not implemented");
        goto cleanup;
    }
    double terminal;
    item = cJSON_GetObjectItemCaseSensitive(root, "shift_terminal");
    if (item && !cJSON_IsNull(item) && !cJSON_IsFalse(item)) {
        DIT_CHECK(dit_json_get_double(root, "shift_terminal", path, false, 0.0, &terminal, diag));
        if (terminal != 0.0) {
            st = refuse(diag, path, "shift_terminal", "not implemented");
            goto cleanup;
        }
    }
    DIT_CHECK(dit_json_get_double(root, "flow_shift", path, false, 1.0, &c.flow_shift, diag));
    DIT_CHECK(dit_json_get_bool(root, "lower_order_final", path, false, true, &c.lower_order_final,
                                diag));
    /* diffusers maps the DPM-Solver names to bh2. */
    DIT_CHECK(dit_json_get_string(root, "solver_type", path, false, &str, diag));
    if (str && strcmp(str, "bh1") == 0) {
        c.bh1 = true;
    } else if (str && strcmp(str, "bh2") != 0 && strcmp(str, "midpoint") != 0 &&
               strcmp(str, "heun") != 0 && strcmp(str, "logrho") != 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: unknown solver_type \"%s\" (bh1 or bh2)", path,
                          str);
        goto cleanup;
    }
    DIT_CHECK(dit_json_get_string(root, "final_sigmas_type", path, false, &str, diag));
    if (str && strcmp(str, "sigma_min") == 0) {
        c.final_sigma_min = true;
    } else if (str && strcmp(str, "zero") != 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: unknown final_sigmas_type \"%s\" (zero or sigma_min)", path, str);
        goto cleanup;
    }
    if (c.bh1 && !c.final_sigma_min) {
        st = refuse(diag, path, "solver_type bh1 and final_sigmas_type zero",
                    "B(h) is -inf on the last step and diffusers returns NaN");
        goto cleanup;
    }
    DIT_CHECK(dit_json_get_string(root, "timestep_spacing", path, false, &str, diag));
    if (str && strcmp(str, "linspace") != 0 && strcmp(str, "leading") != 0 &&
        strcmp(str, "trailing") != 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: unknown timestep_spacing \"%s\" (linspace, leading or trailing)",
                          path, str);
        goto cleanup;
    }
    DIT_CHECK(dit_json_get_string(root, "beta_schedule", path, false, &str, diag));
    if (str && strcmp(str, "linear") != 0 && strcmp(str, "scaled_linear") != 0 &&
        strcmp(str, "squaredcos_cap_v2") != 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: unknown beta_schedule \"%s\"", path, str);
        goto cleanup;
    }
    item = cJSON_GetObjectItemCaseSensitive(root, "disable_corrector");
    if (item && !cJSON_IsNull(item))
        DIT_CHECK(dit_json_get_int_array(root, "disable_corrector", path, c.disable_corrector,
                                         DIT_UNIPC_MAX_DISABLED, &c.n_disable_corrector, diag));
    *out = c;
cleanup:
    cJSON_Delete(root);
    return st;
}

dit_status dit_unipc_schedule(const dit_unipc_config *c, int steps, float *sigmas,
                              int64_t *timesteps, dit_diag *diag)
{
    if (steps < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "steps must be at least 1, not %d", steps);
    /* np.linspace(1, 1/T, N + 1)[:-1] in f64: i * step + start. */
    const double T = (double)c->num_train_timesteps;
    const double start = 1.0, stop = 1.0 / T;
    const double step = (stop - start) / (double)steps;
    const double s = c->flow_shift, sm1 = c->flow_shift - 1.0;
    double last = 0.0;
    for (int i = 0; i < steps; i++) {
        const double lin = (double)i * step;
        const double sg = lin + start;
        const double num = s * sg;
        const double den0 = sm1 * sg;
        const double den = 1.0 + den0;
        double shifted = num / den;
        /* diffusers keeps log(alpha) finite on the first steps. */
        if (i == 0 && fabs(shifted - 1.0) < 1e-6)
            shifted -= 1e-6;
        last = shifted;
        const double t = shifted * T;
        timesteps[i] = (int64_t)t;
        sigmas[i] = (float)shifted;
    }
    sigmas[steps] = c->final_sigma_min ? (float)last : 0.0f;
    return DIT_OK;
}

/* The step, in f32. Scalars are diffusers' 0-dim f32 tensors; every
 * statement is one rounding, as torch does it. */

typedef struct unipc {
    dit_unipc_config c;
    int steps;
    size_t n;                            /* elements each buffer holds */
    float *buf[DIT_UNIPC_MAX_ORDER + 2]; /* model outputs and the last sample */
    float *hist[DIT_UNIPC_MAX_ORDER];    /* x0 predictions, newest last */
    float *spare;                        /* the next step's x0 prediction */
    float *last;                         /* the sample before the last predictor */
    int lower_order_nums;
    int this_order;
    bool have_last;
} unipc;

static float logf_(float x)
{
    return (float)log((double)x);
}

static float expm1f_(float x)
{
    return (float)expm1((double)x);
}

/* lambda = log(alpha) - log(sigma), alpha = 1 - sigma (flow sigmas). */
static float lambda_of(float sigma)
{
    const float alpha = 1.0f - sigma;
    const float la = logf_(alpha);
    const float ls = logf_(sigma);
    return la - ls;
}

/* torch.linalg.solve (LAPACK getrf + getrs, MKL in torch's builds) on an
 * n x n f32 system: LU with partial pivoting (the first largest |pivot|),
 * the column scaled by the pivot's reciprocal, forward substitution, and back
 * substitution multiplying by the diagonal's reciprocal. Bit-identical to
 * torch's for the 2 x 2 systems of order 2 (checked on random systems); 3 x 3
 * ones (order 3) differ in the last bits. b becomes x. */
static void solve_small(int n, float a[DIT_UNIPC_MAX_ORDER][DIT_UNIPC_MAX_ORDER], float *b)
{
    for (int k = 0; k < n; k++) {
        int p = k;
        for (int i = k + 1; i < n; i++)
            if (fabsf(a[i][k]) > fabsf(a[p][k]))
                p = i;
        if (p != k) {
            for (int j = 0; j < n; j++) {
                const float t = a[k][j];
                a[k][j] = a[p][j];
                a[p][j] = t;
            }
            const float t = b[k];
            b[k] = b[p];
            b[p] = t;
        }
        const float r = 1.0f / a[k][k];
        for (int i = k + 1; i < n; i++)
            a[i][k] = a[i][k] * r;
        for (int i = k + 1; i < n; i++)
            for (int j = k + 1; j < n; j++) {
                const float d = a[i][k] * a[k][j];
                a[i][j] = a[i][j] - d;
            }
    }
    for (int k = 0; k < n; k++)
        for (int i = k + 1; i < n; i++) {
            const float d = b[k] * a[i][k];
            b[i] = b[i] - d;
        }
    for (int k = n - 1; k >= 0; k--) {
        const float r = 1.0f / a[k][k];
        b[k] = b[k] * r;
        for (int i = 0; i < k; i++) {
            const float d = b[k] * a[i][k];
            b[i] = b[i] - d;
        }
    }
}

/* What UniP and UniC share for an update from sigma_s0 to sigma_t of order p
 * with the earlier sigmas sig_si[0 .. p-2]: rks, h_phi_1, B(h) and the
 * solved rhos (p_solve = p - 1 for the predictor, p for the corrector). */
typedef struct coeffs {
    float rk[DIT_UNIPC_MAX_ORDER];
    float rhos[DIT_UNIPC_MAX_ORDER];
    float h_phi_1, b_h;
} coeffs;

static void make_coeffs(const unipc *u, float sigma_t, float sigma_s0, const float *sig_si, int p,
                        bool corrector, coeffs *k)
{
    const float lt = lambda_of(sigma_t), ls0 = lambda_of(sigma_s0);
    const float h = lt - ls0;
    float rks[DIT_UNIPC_MAX_ORDER];
    for (int i = 0; i < p - 1; i++) {
        const float lsi = lambda_of(sig_si[i]);
        const float d = lsi - ls0;
        rks[i] = d / h;
        k->rk[i] = rks[i];
    }
    rks[p - 1] = 1.0f;
    const float hh = -h;
    const float h_phi_1 = expm1f_(hh);
    float h_phi_k = h_phi_1 / hh;
    h_phi_k = h_phi_k - 1.0f;
    const float b_h = u->c.bh1 ? hh : expm1f_(hh);
    float R[DIT_UNIPC_MAX_ORDER][DIT_UNIPC_MAX_ORDER], b[DIT_UNIPC_MAX_ORDER];
    int64_t factorial = 1;
    for (int i = 1; i <= p; i++) {
        for (int j = 0; j < p; j++) {
            float pw = 1.0f;
            if (i - 1 == 1)
                pw = rks[j];
            else if (i - 1 == 2)
                pw = rks[j] * rks[j];
            R[i - 1][j] = pw;
        }
        const float num = h_phi_k * (float)factorial;
        b[i - 1] = num / b_h;
        factorial *= i + 1;
        const float q = h_phi_k / hh;
        h_phi_k = q - (float)(1.0 / (double)factorial);
    }
    k->h_phi_1 = h_phi_1;
    k->b_h = b_h;
    if (!corrector) {
        if (p == 2) {
            k->rhos[0] = 0.5f;
        } else if (p > 2) {
            memcpy(k->rhos, b, sizeof b);
            solve_small(p - 1, R, k->rhos);
        }
    } else {
        if (p == 1) {
            k->rhos[0] = 0.5f;
        } else {
            memcpy(k->rhos, b, sizeof b);
            solve_small(p, R, k->rhos);
        }
    }
}

/* sum_k rhos[k] * (m_k - m0) / rk[k] over K = nk earlier outputs (einsum). */
static float weighted_d1(const coeffs *k, int nk, float *const *mk, const float *m0, size_t e)
{
    float acc = 0.0f;
    for (int j = 0; j < nk; j++) {
        const float diff = mk[j][e] - m0[e];
        const float d1 = diff / k->rk[j];
        const float t = k->rhos[j] * d1;
        acc = j == 0 ? t : acc + t;
    }
    return acc;
}

/* UniP of order p at step i: x (the corrected sample) becomes the sample at
 * sigmas[i + 1]. hist holds the x0 predictions, newest last. */
static void predict(const unipc *u, int i, int p, const float *sigmas, float *x, size_t n)
{
    const int order = u->c.solver_order;
    const float sigma_t = sigmas[i + 1], sigma_s0 = sigmas[i];
    float sig_si[DIT_UNIPC_MAX_ORDER];
    float *mk[DIT_UNIPC_MAX_ORDER];
    for (int j = 1; j < p; j++) {
        sig_si[j - 1] = sigmas[i - j];
        mk[j - 1] = u->hist[order - 1 - j];
    }
    coeffs k;
    make_coeffs(u, sigma_t, sigma_s0, sig_si, p, false, &k);
    const float *m0 = u->hist[order - 1];
    const float alpha_t = 1.0f - sigma_t;
    const float cx = sigma_t / sigma_s0;
    const float cm = alpha_t * k.h_phi_1;
    const float cr = alpha_t * k.b_h;
    const float c0 = cr * 0.0f; /* pred_res = 0 for order 1 */
    for (size_t e = 0; e < n; e++) {
        const float a = cx * x[e];
        const float b = cm * m0[e];
        const float xt = a - b;
        if (p == 1) {
            x[e] = xt - c0;
        } else {
            const float pred = weighted_d1(&k, p - 1, mk, m0, e);
            const float d = cr * pred;
            x[e] = xt - d;
        }
    }
}

/* UniC of order p at step i (> 0): corrects x, the predictor's output for
 * sigmas[i], with model_t, the x0 prediction at x; hist is still the
 * history before step i. */
static void correct(const unipc *u, int i, int p, const float *sigmas, float *x,
                    const float *model_t, size_t n)
{
    const int order = u->c.solver_order;
    const float sigma_t = sigmas[i], sigma_s0 = sigmas[i - 1];
    float sig_si[DIT_UNIPC_MAX_ORDER];
    float *mk[DIT_UNIPC_MAX_ORDER];
    for (int j = 1; j < p; j++) {
        sig_si[j - 1] = sigmas[i - (j + 1)];
        mk[j - 1] = u->hist[order - 1 - j];
    }
    coeffs k;
    make_coeffs(u, sigma_t, sigma_s0, sig_si, p, true, &k);
    const float *m0 = u->hist[order - 1];
    const float *last = u->last;
    const float alpha_t = 1.0f - sigma_t;
    const float cx = sigma_t / sigma_s0;
    const float cm = alpha_t * k.h_phi_1;
    const float cr = alpha_t * k.b_h;
    const float r_t = k.rhos[p - 1];
    for (size_t e = 0; e < n; e++) {
        const float a = cx * last[e];
        const float b = cm * m0[e];
        const float xt = a - b;
        const float d1t = model_t[e] - m0[e];
        const float rt = r_t * d1t;
        float corr;
        if (p == 1) {
            corr = rt + 0.0f;
        } else {
            const float res = weighted_d1(&k, p - 1, mk, m0, e);
            corr = res + rt;
        }
        const float d = cr * corr;
        x[e] = xt - d;
    }
}

static void unipc_free(void *p)
{
    unipc *u = p;
    if (!u)
        return;
    for (int i = 0; i < DIT_UNIPC_MAX_ORDER + 2; i++)
        free(u->buf[i]);
    free(u);
}

static dit_status unipc_load(const char *path, void **out, dit_diag *diag)
{
    unipc *u = calloc(1, sizeof *u);
    if (!u)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    dit_status st = dit_unipc_config_load(path, &u->c, diag);
    if (st != DIT_OK) {
        free(u);
        return st;
    }
    *out = u;
    return DIT_OK;
}

static dit_status unipc_schedule(const void *s, int steps, int64_t seq_len, float *sigmas,
                                 float *timesteps, dit_diag *diag)
{
    (void)seq_len;
    const unipc *u = s;
    int64_t *ts = malloc(sizeof(int64_t) * (size_t)(steps > 0 ? steps : 1));
    if (!ts)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    dit_status st = dit_unipc_schedule(&u->c, steps, sigmas, ts, diag);
    if (st == DIT_OK)
        for (int i = 0; i < steps; i++)
            timesteps[i] = (float)ts[i]; /* at most num_train_timesteps: exact */
    free(ts);
    return st;
}

static void reset(unipc *u)
{
    u->lower_order_nums = 0;
    u->this_order = 0;
    u->have_last = false;
}

static dit_status unipc_start(void *s, int steps, dit_diag *diag)
{
    (void)diag;
    unipc *u = s;
    u->steps = steps;
    reset(u);
    return DIT_OK;
}

/* Buffers for n elements, allocated on a generation's first step. */
static dit_status ensure_buffers(unipc *u, size_t n, dit_diag *diag)
{
    if (u->n == n && u->buf[0])
        return DIT_OK;
    const int nb = u->c.solver_order + 2;
    u->n = 0; /* none until all are there */
    for (int i = 0; i < nb; i++) {
        free(u->buf[i]);
        u->buf[i] = n <= SIZE_MAX / sizeof(float) ? malloc(sizeof(float) * (n ? n : 1)) : NULL;
        if (!u->buf[i])
            return dit_diag_set(diag, DIT_ERR_NOMEM,
                                "UniPCMultistepScheduler: out of memory for the history of %zu "
                                "latents",
                                n);
    }
    u->n = n;
    for (int i = 0; i < u->c.solver_order; i++)
        u->hist[i] = u->buf[i];
    u->spare = u->buf[u->c.solver_order];
    u->last = u->buf[u->c.solver_order + 1];
    return DIT_OK;
}

static bool corrector_disabled(const unipc *u, int i)
{
    for (int j = 0; j < u->c.n_disable_corrector; j++)
        if (u->c.disable_corrector[j] == i)
            return true;
    return false;
}

static dit_status unipc_step(void *s, int i, const float *sigmas, float *x, const float *v,
                             size_t n, dit_diag *diag)
{
    unipc *u = s;
    const int order = u->c.solver_order;
    if (i == 0) {
        reset(u);
        const dit_status st = ensure_buffers(u, n, diag);
        if (st != DIT_OK)
            return st;
    } else if (u->n != n || !u->buf[0]) {
        return dit_diag_set(diag, DIT_ERR_INTERNAL,
                            "UniPCMultistepScheduler: step %d of %zu latents without step 0", i, n);
    }
    /* convert_model_output: x0 = sample - sigma * v. */
    float *m = u->spare;
    const float sigma = sigmas[i];
    for (size_t e = 0; e < n; e++) {
        const float t = sigma * v[e];
        m[e] = x[e] - t;
    }
    if (i > 0 && !corrector_disabled(u, i - 1) && u->have_last)
        correct(u, i, u->this_order, sigmas, x, m, n);
    /* The history moves on: the oldest output becomes the spare buffer. */
    u->spare = u->hist[0];
    for (int j = 0; j + 1 < order; j++)
        u->hist[j] = u->hist[j + 1];
    u->hist[order - 1] = m;
    int this_order = order;
    if (u->c.lower_order_final && u->steps - i < this_order)
        this_order = u->steps - i;
    if (u->lower_order_nums + 1 < this_order)
        this_order = u->lower_order_nums + 1;
    u->this_order = this_order;
    memcpy(u->last, x, sizeof(float) * n);
    u->have_last = true;
    predict(u, i, this_order, sigmas, x, n);
    if (u->lower_order_nums < order)
        u->lower_order_nums++;
    return DIT_OK;
}

const dit_scheduler_class dit_unipc_class = {
    .diffusers_class = "UniPCMultistepScheduler",
    .load = unipc_load,
    .free = unipc_free,
    .schedule = unipc_schedule,
    .step = unipc_step,
    .start = unipc_start,
};
