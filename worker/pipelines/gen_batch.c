#include "pipelines/gen_batch.h"

#include <stdlib.h>
#include <string.h>

dit_status dit_gen_batch_init(dit_gen_batch *b, const dit_pipeline_info *info, int n,
                              const dit_gen_params *gps, dit_gen_result *res, dit_status *member_st,
                              dit_diag *diag)
{
    memset(b, 0, sizeof *b);
    if (n < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "a batch needs at least one member, not %d",
                            n);
    for (int m = 0; m < n; m++) {
        memset(&res[m], 0, sizeof res[m]);
        member_st[m] = DIT_OK;
    }
    for (int m = 0; m < n; m++) {
        dit_status st = dit_gen_check(info, &gps[m], diag);
        if (st != DIT_OK && n > 1)
            dit_diag_prefix(diag, "batch member %d: ", m);
        if (st == DIT_OK && m > 0 && !dit_gen_batch_compatible(info, &gps[0], &gps[m]))
            st = dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                              "batch member %d cannot share forwards with member 0 (size, "
                              "frames, steps, text length, CFG or cfg_two_pass differ)",
                              m);
        if (st != DIT_OK) {
            for (int k = 0; k < n; k++)
                member_st[k] = st;
            return st;
        }
    }
    /* One block: off, ni (int64), then active, mask (bool). */
    const size_t n_ = (size_t)n;
    char *blk = calloc(1, n_ * (2 * sizeof(int64_t) + 2 * sizeof(bool)));
    if (!blk) {
        for (int k = 0; k < n; k++)
            member_st[k] = DIT_ERR_NOMEM; /* as for any failure: every member's */
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    }
    b->off = (int64_t *)blk;
    b->ni = b->off + n_;
    b->active = (bool *)(b->ni + n_);
    b->mask = b->active + n_;
    b->n = n;
    for (int m = 0; m < n; m++) {
        b->off[m] = b->total;
        b->ni[m] = dit_gen_num_images(&gps[m]);
        b->total += b->ni[m];
        b->active[m] = true;
    }
    b->n_active = n;
    b->images = b->total;
    return DIT_OK;
}

void dit_gen_batch_free(dit_gen_batch *b)
{
    free(b->off);
    memset(b, 0, sizeof *b);
}

int64_t dit_gen_batch_gather(const dit_gen_batch *b, const float *src, int64_t per, float *dst)
{
    int64_t e = 0;
    for (int m = 0; m < b->n; m++) {
        if (!b->active[m])
            continue;
        memcpy(dst + e * per, src + b->off[m] * per, sizeof(float) * (size_t)(b->ni[m] * per));
        e += b->ni[m];
    }
    return e;
}

void dit_gen_batch_scatter(const dit_gen_batch *b, const float *src, int64_t per, float *dst)
{
    int64_t e = 0;
    for (int m = 0; m < b->n; m++) {
        if (!b->active[m])
            continue;
        memcpy(dst + b->off[m] * per, src + e * per, sizeof(float) * (size_t)(b->ni[m] * per));
        e += b->ni[m];
    }
}

dit_status dit_gen_batch_progress(dit_gen_batch *b, dit_gen_batch_progress_fn progress, void *ctx,
                                  int step, int total, double elapsed_ms, dit_gen_result *res,
                                  dit_status *member_st, float *v, int64_t per, bool *changed,
                                  dit_diag *diag)
{
    *changed = false;
    if (!progress)
        return DIT_OK;
    memcpy(b->mask, b->active, sizeof(bool) * (size_t)b->n);
    dit_status st = progress(ctx, step, total, elapsed_ms, b->mask);
    if (st != DIT_OK)
        return st;
    for (int m = 0; m < b->n; m++) {
        if (!b->active[m] || b->mask[m])
            continue;
        b->active[m] = false;
        b->n_active--;
        b->images -= b->ni[m];
        member_st[m] = DIT_ERR_CANCELLED;
        dit_gen_result_free(&res[m]);
        memset(&res[m], 0, sizeof res[m]);
        memset(v + b->off[m] * per, 0, sizeof(float) * (size_t)(b->ni[m] * per));
        *changed = true;
    }
    if (b->n_active == 0)
        return dit_diag_set(diag, DIT_ERR_CANCELLED, "every member of the batch left at step %d",
                            step);
    return DIT_OK;
}

void dit_gen_batch_fail(const dit_gen_batch *b, dit_status st, dit_gen_result *res,
                        dit_status *member_st)
{
    for (int m = 0; m < b->n; m++) {
        dit_gen_result_free(&res[m]);
        if (member_st[m] == DIT_OK)
            member_st[m] = st;
    }
}

void dit_gen_batch_cfg(const dit_gen_batch *b, float *out, int64_t per, const dit_gen_params *gps,
                       dit_gen_cfg_scale which)
{
    int64_t e = 0;
    for (int m = 0; m < b->n; m++) {
        if (!b->active[m])
            continue;
        float *pos = out + e * per;
        const float *neg = out + (b->images + e) * per;
        const float scale =
            which == DIT_GEN_CFG_TRUE ? gps[m].true_cfg_scale : gps[m].guidance_scale;
        for (int64_t k = 0; k < b->ni[m] * per; k++) {
            const float diff = pos[k] - neg[k];
            const float scaled = scale * diff;
            pos[k] = neg[k] + scaled;
        }
        e += b->ni[m];
    }
}

void dit_gen_batch_step_time(dit_gen_result *res, int n, double step_ms, double *min, double *max)
{
    *min = step_ms < *min ? step_ms : *min;
    *max = step_ms > *max ? step_ms : *max;
    for (int m = 0; m < n; m++) {
        res[m].step_ms_min = *min;
        res[m].step_ms_max = *max;
    }
}

void dit_gen_batch_finish(const dit_gen_batch *b, dit_gen_result *res, const float *lat,
                          int64_t per, double denoise_ms)
{
    for (int m = 0; m < b->n; m++)
        if (b->active[m]) {
            res[m].denoise_ms = denoise_ms;
            memcpy(res[m].latents, lat + b->off[m] * per, sizeof(float) * (size_t)(b->ni[m] * per));
        }
}

bool dit_gen_batch_decodes_image(const dit_gen_batch *b, const dit_gen_decode *decode, int m,
                                 int64_t i)
{
    return decode && m >= 0 && m < b->n && b->active[m] && i >= 0 && i < b->ni[m] &&
           i < DIT_GEN_MAX_IMAGES && (decode[m] >> i & 1u);
}

bool dit_gen_batch_decodes(const dit_gen_batch *b, const dit_gen_decode *decode, int m)
{
    for (int64_t i = 0; m >= 0 && m < b->n && i < b->ni[m]; i++)
        if (dit_gen_batch_decodes_image(b, decode, m, i))
            return true;
    return false;
}

bool dit_gen_batch_decodes_any(const dit_gen_batch *b, const dit_gen_decode *decode)
{
    for (int m = 0; m < b->n; m++)
        if (dit_gen_batch_decodes(b, decode, m))
            return true;
    return false;
}
