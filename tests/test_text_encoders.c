/* FluxPipeline's text encoders (CLIPTextModel, T5EncoderModel) on the CPU
 * backend against transformers' f32 outputs in tests/data/text_encoders (made
 * by tests/golden/gen_text_encoder_golden.py), plus loading errors: each way a
 * checkpoint or config.json can be wrong must give an error naming the tensor
 * or key and the file. Variants of the fixtures (other tensor names, broken
 * checkpoints) are written into a temporary folder. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "loader/safetensors.h"
#include "encoders/clip_text.h"
#include "encoders/t5_encoder.h"

/* max|ours - transformers| / max|transformers|: f32 implementations of the
 * same graph differ by summation order only. */
#define REL_TOL 1e-5

static dit_backend *be;
static dit_arena *arena;
static char tmp_dir[64];

static void setup(void)
{
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 0};
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_backend_create(&cfg, &be, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_arena_create(be, 0, &arena), DIT_OK);
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/dit_text_enc_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmp_dir));
}

static void teardown(void)
{
    const char *files[] = {"config.json", "model.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        char p[128];
        snprintf(p, sizeof p, "%s/%s", tmp_dir, files[i]);
        unlink(p);
    }
    rmdir(tmp_dir);
    dit_arena_destroy(arena);
    dit_backend_destroy(be);
}

static void case_dir(const char *name, char *buf, size_t cap)
{
    const char *root = getenv("DIT_SOURCE_ROOT");
    snprintf(buf, cap, "%s/tests/data/text_encoders/%s", root ? root : ".", name);
}

/* ------------------------------------------------------------------------ */
/* Fixture rewriting                                                         */

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void write_file(const char *name, const char *text)
{
    char p[256];
    snprintf(p, sizeof p, "%s/%s", tmp_dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* Copies a case's config.json, replacing the first `from` by `to` when given. */
static void copy_config(const char *cname, const char *from, const char *to)
{
    char d[1024], p[1100];
    case_dir(cname, d, sizeof d);
    snprintf(p, sizeof p, "%s/config.json", d);
    char *text = read_text(p);
    if (from) {
        char *at = strstr(text, from);
        ck_assert_msg(at != NULL, "'%s' not in %s", from, p);
        size_t nf = strlen(from), nt = strlen(to), rest = strlen(at + nf);
        char *out = malloc(strlen(text) - nf + nt + 1);
        memcpy(out, text, (size_t)(at - text));
        memcpy(out + (at - text), to, nt);
        memcpy(out + (at - text) + nt, at + nf, rest + 1);
        free(text);
        text = out;
    }
    write_file("config.json", text);
    free(text);
}

typedef enum edit_kind {
    EDIT_NONE,
    EDIT_DROP,    /* remove tensor `name` */
    EDIT_RESHAPE, /* drop the last row of `name` */
    EDIT_EXTRA,   /* add `name` as a copy of tensor `arg` */
    EDIT_RENAME,  /* rename `name` to `arg` */
    EDIT_PREFIX,  /* prepend `arg` to every name */
    EDIT_STRIP,   /* remove the prefix `arg` from every name */
} edit_kind;

/* Rewrites a case's model.safetensors into tmp_dir with one edit applied. */
static void write_model(const char *cname, edit_kind kind, const char *name, const char *arg)
{
    char d[1024], p[1100];
    case_dir(cname, d, sizeof d);
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    dit_st_file *f;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_st_file_open(p, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    size_t n = dit_st_file_count(f);
    dit_st_write_item *items = calloc(n + 1, sizeof *items);
    dit_tensor *views = calloc(n + 1, sizeof *views);
    char(*names)[192] = calloc(n + 1, sizeof *names);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        const bool hit = name && strcmp(e->name, name) == 0;
        if (hit && kind == EDIT_DROP)
            continue;
        views[k] = e->view;
        if (hit && kind == EDIT_RESHAPE)
            views[k] = dit_tensor_narrow(&e->view, 0, 0, e->view.ne[0] - 1);
        const char *nm = e->name;
        if (hit && kind == EDIT_RENAME)
            nm = arg;
        if (kind == EDIT_PREFIX) {
            snprintf(names[k], sizeof names[k], "%s%s", arg, e->name);
            nm = names[k];
        } else if (kind == EDIT_STRIP && strncmp(nm, arg, strlen(arg)) == 0) {
            nm += strlen(arg);
        }
        if (nm != names[k])
            snprintf(names[k], sizeof names[k], "%s", nm);
        items[k].name = names[k];
        items[k].tensor = &views[k];
        k++;
    }
    if (kind == EDIT_EXTRA) {
        const dit_st_entry *src = dit_st_file_find(f, arg);
        ck_assert_msg(src != NULL, "no tensor %s", arg);
        views[k] = src->view;
        snprintf(names[k], sizeof names[k], "%s", name);
        items[k].name = names[k];
        items[k].tensor = &views[k];
        k++;
    }
    snprintf(p, sizeof p, "%s/model.safetensors", tmp_dir);
    ck_assert_msg(dit_st_write(p, items, k, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    free(items);
    free(views);
    free(names);
    dit_st_file_close(f);
}

/* ------------------------------------------------------------------------ */
/* Golden comparison                                                         */

/* A whole f32 copy of a tensor of io.safetensors (views may be misaligned). */
static float *io_tensor(dit_st_file *io, const char *name, const dit_tensor **view)
{
    const dit_st_entry *e = dit_st_file_find(io, name);
    if (!e)
        return NULL;
    size_t n = (size_t)dit_tensor_numel(&e->view);
    float *p = malloc(n * sizeof *p + 1);
    dit_convert_to_f32(p, e->view.data, e->view.dtype, n);
    if (view)
        *view = &e->view;
    return p;
}

typedef struct rel_err {
    double max_abs, max_ref, rel;
} rel_err;

static rel_err compare(const float *got, const float *want, size_t n)
{
    rel_err r = {0, 0, 0};
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        if (!(d <= r.max_abs)) /* NaN propagates */
            r.max_abs = d;
        if (fabs((double)want[i]) > r.max_ref)
            r.max_ref = fabs((double)want[i]);
    }
    r.rel = r.max_ref > 0 ? r.max_abs / r.max_ref : r.max_abs;
    return r;
}

static int32_t *ids_from(const float *f, size_t n)
{
    int32_t *ids = malloc(n * sizeof *ids + 1);
    for (size_t i = 0; i < n; i++)
        ids[i] = (int32_t)f[i];
    return ids;
}

/* Runs every run<k> of io.safetensors in `iodir` through a loaded CLIP model.
 * With `with_hidden` the last hidden state is compared too; without it only
 * the pooled output is asked for (the other code path). */
static void check_clip_runs(dit_clip_text *m, const char *iodir, const char *label,
                            bool with_hidden)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/io.safetensors", iodir);
    dit_st_file *io;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_st_file_open(p, &io, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const int64_t C = dit_clip_text_hidden_size(m);
    int runs = 0;
    for (int k = 0;; k++, runs++) {
        char name[64];
        const dit_tensor *idv;
        snprintf(name, sizeof name, "run%d.ids", k);
        float *idf = io_tensor(io, name, &idv);
        if (!idf)
            break;
        const int64_t B = idv->ne[0], S = idv->ne[1];
        int32_t *ids = ids_from(idf, (size_t)(B * S));
        snprintf(name, sizeof name, "run%d.last_hidden_state", k);
        float *want_h = io_tensor(io, name, NULL);
        snprintf(name, sizeof name, "run%d.pooler_output", k);
        float *want_p = io_tensor(io, name, NULL);
        ck_assert(want_h && want_p);

        dit_arena_reset(arena);
        dit_tensor pooled, hidden;
        const int64_t shp[2] = {B, C}, shh[3] = {B, S, C};
        ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 2, shp, &pooled), DIT_OK);
        ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, shh, &hidden), DIT_OK);
        dit_diag_clear(&diag);
        dit_status st = dit_clip_text_forward(m, arena, ids, B, S, &pooled,
                                              with_hidden ? &hidden : NULL, &diag);
        ck_assert_msg(st == DIT_OK, "%s run%d: %s", label, k, dit_diag_msg(&diag));
        float *got_h = malloc(sizeof(float) * (size_t)(B * S * C));
        float *got_p = malloc(sizeof(float) * (size_t)(B * C));
        dit_tensor hh = dit_tensor_3d(got_h, DIT_F32, B, S, C);
        dit_tensor hp = dit_tensor_2d(got_p, DIT_F32, B, C);
        ck_assert_int_eq(be->ops->download(be, &hp, &pooled), DIT_OK);
        rel_err ep = compare(got_p, want_p, (size_t)(B * C));
        if (with_hidden) {
            ck_assert_int_eq(be->ops->download(be, &hh, &hidden), DIT_OK);
            rel_err eh = compare(got_h, want_h, (size_t)(B * S * C));
            printf("%-34s run%d (%lldx%lld): last_hidden_state max abs %.3g / max|ref| %.3g = "
                   "rel %.3g; pooler_output rel %.3g\n",
                   label, k, (long long)B, (long long)S, eh.max_abs, eh.max_ref, eh.rel, ep.rel);
            ck_assert_msg(eh.rel <= REL_TOL, "%s run%d: last_hidden_state rel error %g", label, k,
                          eh.rel);
        } else {
            printf("%-34s run%d (%lldx%lld): pooler_output only, rel %.3g\n", label, k,
                   (long long)B, (long long)S, ep.rel);
        }
        ck_assert_msg(ep.rel <= REL_TOL, "%s run%d: pooler_output rel error %g", label, k, ep.rel);
        free(idf);
        free(ids);
        free(want_h);
        free(want_p);
        free(got_h);
        free(got_p);
    }
    ck_assert_int_gt(runs, 0);
    dit_st_file_close(io);
}

static void check_t5_runs(dit_t5_encoder *m, const char *iodir, const char *label)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/io.safetensors", iodir);
    dit_st_file *io;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_st_file_open(p, &io, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const int64_t Dm = dit_t5_encoder_d_model(m);
    int runs = 0;
    for (int k = 0;; k++, runs++) {
        char name[64];
        const dit_tensor *idv;
        snprintf(name, sizeof name, "run%d.ids", k);
        float *idf = io_tensor(io, name, &idv);
        if (!idf)
            break;
        const int64_t B = idv->ne[0], S = idv->ne[1];
        int32_t *ids = ids_from(idf, (size_t)(B * S));
        snprintf(name, sizeof name, "run%d.last_hidden_state", k);
        float *want = io_tensor(io, name, NULL);
        ck_assert_ptr_nonnull(want);

        dit_arena_reset(arena);
        dit_tensor out;
        const int64_t sh[3] = {B, S, Dm};
        ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, sh, &out), DIT_OK);
        dit_diag_clear(&diag);
        dit_status st = dit_t5_encoder_forward(m, arena, ids, B, S, &out, &diag);
        ck_assert_msg(st == DIT_OK, "%s run%d: %s", label, k, dit_diag_msg(&diag));
        float *got = malloc(sizeof(float) * (size_t)(B * S * Dm));
        dit_tensor hg = dit_tensor_3d(got, DIT_F32, B, S, Dm);
        ck_assert_int_eq(be->ops->download(be, &hg, &out), DIT_OK);
        rel_err e = compare(got, want, (size_t)(B * S * Dm));
        printf("%-34s run%d (%lldx%lld): last_hidden_state max abs %.3g / max|ref| %.3g = rel "
               "%.3g\n",
               label, k, (long long)B, (long long)S, e.max_abs, e.max_ref, e.rel);
        ck_assert_msg(e.rel <= REL_TOL, "%s run%d: rel error %g", label, k, e.rel);
        free(idf);
        free(ids);
        free(want);
        free(got);
    }
    ck_assert_int_gt(runs, 0);
    dit_st_file_close(io);
}

static const char *const CLIP_CASES[] = {"clip_legacy_eos", "clip_first_eos"};
static const char *const T5_CASES[] = {"t5_gated_gelu", "t5_relu_bf16"};

START_TEST(clip_matches_transformers)
{
    char d[1024];
    case_dir(CLIP_CASES[_i], d, sizeof d);
    dit_clip_text *m = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_clip_text_load(be, d, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_clip_text_hidden_size(m), 32);
    ck_assert_int_eq(dit_clip_text_max_length(m), 77);
    check_clip_runs(m, d, CLIP_CASES[_i], true);
    check_clip_runs(m, d, CLIP_CASES[_i], false);
    dit_clip_text_free(m);
}
END_TEST

START_TEST(t5_matches_transformers)
{
    char d[1024];
    case_dir(T5_CASES[_i], d, sizeof d);
    dit_t5_encoder *m = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_t5_encoder_load(be, d, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_t5_encoder_d_model(m), 32);
    check_t5_runs(m, d, T5_CASES[_i]);
    dit_t5_encoder_free(m);
}
END_TEST

/* The same weights under the other naming (prefixed <-> flat) load and give
 * the same outputs. */
START_TEST(clip_tensor_name_prefixes)
{
    char d[1024];
    dit_diag diag;
    dit_clip_text *m = NULL;
    /* clip_legacy_eos is stored with "text_model."; strip it. */
    copy_config("clip_legacy_eos", NULL, NULL);
    write_model("clip_legacy_eos", EDIT_STRIP, NULL, "text_model.");
    dit_diag_clear(&diag);
    ck_assert_msg(dit_clip_text_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    case_dir("clip_legacy_eos", d, sizeof d);
    check_clip_runs(m, d, "clip_legacy_eos (flat names)", true);
    dit_clip_text_free(m);
    /* clip_first_eos is flat; add the prefix. */
    copy_config("clip_first_eos", NULL, NULL);
    write_model("clip_first_eos", EDIT_PREFIX, NULL, "text_model.");
    dit_diag_clear(&diag);
    ck_assert_msg(dit_clip_text_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    case_dir("clip_first_eos", d, sizeof d);
    check_clip_runs(m, d, "clip_first_eos (text_model. names)", true);
    dit_clip_text_free(m);
}
END_TEST

/* The tied embedding under its other name, and under both names. */
START_TEST(t5_tied_embedding_names)
{
    char d[1024];
    dit_diag diag;
    dit_t5_encoder *m = NULL;
    case_dir("t5_gated_gelu", d, sizeof d);
    copy_config("t5_gated_gelu", NULL, NULL);
    write_model("t5_gated_gelu", EDIT_RENAME, "shared.weight", "encoder.embed_tokens.weight");
    dit_diag_clear(&diag);
    ck_assert_msg(dit_t5_encoder_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    check_t5_runs(m, d, "t5_gated_gelu (embed_tokens)");
    dit_t5_encoder_free(m);

    write_model("t5_gated_gelu", EDIT_EXTRA, "encoder.embed_tokens.weight", "shared.weight");
    dit_diag_clear(&diag);
    ck_assert_msg(dit_t5_encoder_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    check_t5_runs(m, d, "t5_gated_gelu (shared + embed_tokens)");
    dit_t5_encoder_free(m);

    /* A full T5 checkpoint's decoder is ignored, as T5EncoderModel does. */
    write_model("t5_gated_gelu", EDIT_EXTRA, "decoder.final_layer_norm.weight",
                "encoder.final_layer_norm.weight");
    dit_diag_clear(&diag);
    ck_assert_msg(dit_t5_encoder_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_t5_encoder_free(m);
}
END_TEST

/* dit_t5_relative_bucket against T5Attention._relative_position_bucket. */
START_TEST(t5_buckets_match_pytorch)
{
    char d[1024], p[1100];
    case_dir("t5_gated_gelu", d, sizeof d);
    snprintf(p, sizeof p, "%s/io.safetensors", d);
    dit_st_file *io;
    ck_assert_int_eq(dit_st_file_open(p, &io, NULL), DIT_OK);
    int tables = 0;
    for (size_t i = 0; i < dit_st_file_count(io); i++) {
        const dit_st_entry *e = dit_st_file_at(io, i);
        int nb, md;
        if (sscanf(e->name, "buckets_%d_%d", &nb, &md) != 2)
            continue;
        float *want = io_tensor(io, e->name, NULL);
        const int64_t n = e->view.ne[0], span = (n - 1) / 2;
        for (int64_t j = 0; j < n; j++) {
            int got = dit_t5_relative_bucket(j - span, nb, md);
            ck_assert_msg(got == (int)want[j], "%s: rel %lld: got %d want %d", e->name,
                          (long long)(j - span), got, (int)want[j]);
        }
        free(want);
        tables++;
    }
    ck_assert_int_ge(tables, 4);
    dit_st_file_close(io);
}
END_TEST

/* The pooling rules on hand-made ids. */
START_TEST(clip_eos_position_rules)
{
    char d[1024];
    dit_clip_text *legacy = NULL, *first = NULL;
    case_dir("clip_legacy_eos", d, sizeof d);
    ck_assert_int_eq(dit_clip_text_load(be, d, &legacy, NULL), DIT_OK);
    case_dir("clip_first_eos", d, sizeof d);
    ck_assert_int_eq(dit_clip_text_load(be, d, &first, NULL), DIT_OK);
    /* eos_token_id 2: first maximum. eos_token_id 5: first 5, else 0. */
    const int32_t ids[4][5] = {
        {0, 9, 9, 3, 9},
        {7, 5, 8, 5, 1},
        {1, 2, 3, 4, 6},
        {5, 5, 5, 5, 5},
    };
    int64_t pos[4];
    dit_clip_text_eos_positions(legacy, &ids[0][0], 4, 5, pos);
    ck_assert_int_eq(pos[0], 1);
    ck_assert_int_eq(pos[1], 2);
    ck_assert_int_eq(pos[2], 4);
    ck_assert_int_eq(pos[3], 0);
    dit_clip_text_eos_positions(first, &ids[0][0], 4, 5, pos);
    ck_assert_int_eq(pos[0], 0);
    ck_assert_int_eq(pos[1], 1);
    ck_assert_int_eq(pos[2], 0);
    ck_assert_int_eq(pos[3], 0);
    dit_clip_text_free(legacy);
    dit_clip_text_free(first);
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Loading errors                                                            */

typedef enum which { CLIP, T5 } which;

static void expect_error(which w, dit_status want, const char *needle1, const char *needle2)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st;
    if (w == CLIP) {
        dit_clip_text *m = (dit_clip_text *)1;
        st = dit_clip_text_load(be, tmp_dir, &m, &diag);
        ck_assert_ptr_null(m);
    } else {
        dit_t5_encoder *m = (dit_t5_encoder *)1;
        st = dit_t5_encoder_load(be, tmp_dir, &m, &diag);
        ck_assert_ptr_null(m);
    }
    ck_assert_msg(st == want, "status %s, want %s (%s)", dit_status_name(st), dit_status_name(want),
                  dit_diag_msg(&diag));
    ck_assert_msg(strstr(diag.msg, needle1), "'%s' not in: %s", needle1, diag.msg);
    if (needle2)
        ck_assert_msg(strstr(diag.msg, needle2), "'%s' not in: %s", needle2, diag.msg);
}

START_TEST(clip_checkpoint_errors)
{
    copy_config("clip_legacy_eos", NULL, NULL);
    write_model("clip_legacy_eos", EDIT_DROP, "text_model.encoder.layers.1.mlp.fc2.weight", NULL);
    expect_error(CLIP, DIT_ERR_FORMAT, "'text_model.encoder.layers.1.mlp.fc2.weight' is missing",
                 "does config.json belong");
    write_model("clip_legacy_eos", EDIT_RESHAPE,
                "text_model.encoder.layers.2.self_attn.k_proj.bias", NULL);
    expect_error(CLIP, DIT_ERR_FORMAT,
                 "'text_model.encoder.layers.2.self_attn.k_proj.bias' has shape (31)",
                 "config.json implies (32)");
    write_model("clip_legacy_eos", EDIT_EXTRA, "text_model.encoder.layers.3.mlp.fc1.bias",
                "text_model.encoder.layers.0.mlp.fc1.bias");
    expect_error(CLIP, DIT_ERR_FORMAT,
                 "unexpected tensor 'text_model.encoder.layers.3.mlp.fc1.bias'",
                 "model.safetensors");
    /* Prefix detection is by the token embedding; a mix of the two namings
     * is a missing tensor, named with the prefix in use. */
    write_model("clip_legacy_eos", EDIT_RENAME, "text_model.final_layer_norm.bias",
                "final_layer_norm.bias");
    expect_error(CLIP, DIT_ERR_FORMAT, "'text_model.final_layer_norm.bias' is missing", NULL);
    /* The position_ids buffer older transformers saved is tolerated. */
    write_model("clip_legacy_eos", EDIT_EXTRA, "text_model.embeddings.position_ids",
                "text_model.final_layer_norm.bias");
    dit_clip_text *m = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_clip_text_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_clip_text_free(m);
}
END_TEST

START_TEST(clip_config_errors)
{
    write_model("clip_legacy_eos", EDIT_NONE, NULL, NULL);
    /* A config for 4 layers over a 3-layer checkpoint. */
    copy_config("clip_legacy_eos", "\"num_hidden_layers\": 3", "\"num_hidden_layers\": 4");
    expect_error(CLIP, DIT_ERR_FORMAT, "text_model.encoder.layers.3.", "is missing");
    copy_config("clip_legacy_eos", "\"num_attention_heads\": 4", "\"num_attention_heads\": 5");
    expect_error(CLIP, DIT_ERR_FORMAT, "hidden_size 32 is not divisible by num_attention_heads 5",
                 "config.json");
    copy_config("clip_legacy_eos", "\"hidden_act\": \"quick_gelu\"", "\"hidden_act\": \"mish\"");
    expect_error(CLIP, DIT_ERR_UNSUPPORTED, "hidden_act \"mish\"", "config.json");
    copy_config("clip_legacy_eos", "\"clip_text_model\"", "\"clip\"");
    expect_error(CLIP, DIT_ERR_UNSUPPORTED, "model_type is \"clip\"", NULL);
    copy_config("clip_legacy_eos", "\"hidden_size\": 32", "\"hidden_size\": \"32\"");
    expect_error(CLIP, DIT_ERR_FORMAT, "\"hidden_size\" must be an integer", "config.json");
    copy_config("clip_legacy_eos", "\"layer_norm_eps\": 1e-05", "\"layer_norm_eps\": -1");
    expect_error(CLIP, DIT_ERR_FORMAT, "layer_norm_eps", NULL);
    write_file("config.json", "{\"hidden_size\": 32,");
    expect_error(CLIP, DIT_ERR_FORMAT, "config.json", "invalid JSON");

    dit_diag diag;
    dit_diag_clear(&diag);
    dit_clip_text *m = NULL;
    ck_assert_int_eq(dit_clip_text_load(be, "/nonexistent/text_encoder", &m, &diag),
                     DIT_ERR_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(diag.msg, "/nonexistent/text_encoder/config.json"));
}
END_TEST

START_TEST(t5_checkpoint_errors)
{
    copy_config("t5_gated_gelu", NULL, NULL);
    write_model("t5_gated_gelu", EDIT_DROP, "encoder.block.1.layer.1.DenseReluDense.wi_1.weight",
                NULL);
    expect_error(T5, DIT_ERR_FORMAT,
                 "'encoder.block.1.layer.1.DenseReluDense.wi_1.weight' is missing", NULL);
    write_model("t5_gated_gelu", EDIT_DROP,
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", NULL);
    expect_error(T5, DIT_ERR_FORMAT, "relative_attention_bias.weight' is missing", NULL);
    write_model("t5_gated_gelu", EDIT_RESHAPE,
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", NULL);
    expect_error(T5, DIT_ERR_FORMAT, "relative_attention_bias.weight' has shape (31, 4)",
                 "config.json implies (32, 4)");
    write_model("t5_gated_gelu", EDIT_RESHAPE, "encoder.block.0.layer.0.SelfAttention.o.weight",
                NULL);
    expect_error(T5, DIT_ERR_FORMAT, "'encoder.block.0.layer.0.SelfAttention.o.weight' has shape",
                 "model.safetensors");
    write_model("t5_gated_gelu", EDIT_DROP, "shared.weight", NULL);
    expect_error(T5, DIT_ERR_FORMAT, "neither 'shared.weight' nor 'encoder.embed_tokens.weight'",
                 NULL);
    /* A relative attention bias in a block other than 0 is not a parameter. */
    write_model("t5_gated_gelu", EDIT_EXTRA,
                "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight",
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight");
    expect_error(T5, DIT_ERR_FORMAT,
                 "unexpected tensor 'encoder.block.1.layer.0.SelfAttention.relative_attention_bias",
                 "T5EncoderModel");
    /* Gated checkpoint, config says non-gated. */
    copy_config("t5_gated_gelu", "\"is_gated_act\": true", "\"is_gated_act\": false");
    write_model("t5_gated_gelu", EDIT_NONE, NULL, NULL);
    expect_error(T5, DIT_ERR_FORMAT,
                 "'encoder.block.0.layer.1.DenseReluDense.wi.weight' is missing", NULL);
}
END_TEST

START_TEST(t5_config_errors)
{
    write_model("t5_gated_gelu", EDIT_NONE, NULL, NULL);
    copy_config("t5_gated_gelu", "\"feed_forward_proj\": \"gated-gelu\"",
                "\"feed_forward_proj\": \"gelu-gated\"");
    expect_error(T5, DIT_ERR_FORMAT, "feed_forward_proj \"gelu-gated\"", "config.json");
    copy_config("t5_gated_gelu", "\"dense_act_fn\": \"gelu_new\"", "\"dense_act_fn\": \"elu\"");
    expect_error(T5, DIT_ERR_UNSUPPORTED, "dense activation \"elu\"", NULL);
    copy_config("t5_gated_gelu", "\"relative_attention_max_distance\": 128",
                "\"relative_attention_max_distance\": 8");
    expect_error(T5, DIT_ERR_FORMAT, "relative_attention_max_distance 8 must exceed", NULL);
    copy_config("t5_gated_gelu", "\"relative_attention_num_buckets\": 32",
                "\"relative_attention_num_buckets\": 2");
    expect_error(T5, DIT_ERR_FORMAT, "\"relative_attention_num_buckets\" = 2 is outside", NULL);
    copy_config("t5_gated_gelu", "\"model_type\": \"t5\"", "\"model_type\": \"umt5\"");
    expect_error(T5, DIT_ERR_UNSUPPORTED, "model_type is \"umt5\"", NULL);
    copy_config("t5_gated_gelu", "\"num_heads\": 4", "\"num_heads\": 2");
    expect_error(T5, DIT_ERR_FORMAT, "encoder.block.0.layer.0.SelfAttention.q.weight' has shape",
                 "config.json implies (16, 32)");
    write_file("config.json", "[]");
    expect_error(T5, DIT_ERR_FORMAT, "not a JSON object", NULL);

    dit_diag diag;
    dit_diag_clear(&diag);
    dit_t5_encoder *m = NULL;
    ck_assert_int_eq(dit_t5_encoder_load(be, "/nonexistent/text_encoder_2", &m, &diag),
                     DIT_ERR_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(diag.msg, "/nonexistent/text_encoder_2/config.json"));
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Forward argument errors                                                   */

START_TEST(forward_argument_errors)
{
    char d[1024];
    dit_diag diag;
    dit_clip_text *clip = NULL;
    dit_t5_encoder *t5 = NULL;
    case_dir("clip_first_eos", d, sizeof d);
    ck_assert_int_eq(dit_clip_text_load(be, d, &clip, NULL), DIT_OK);
    case_dir("t5_gated_gelu", d, sizeof d);
    ck_assert_int_eq(dit_t5_encoder_load(be, d, &t5, NULL), DIT_OK);

    int32_t ids[2 * 78];
    for (int i = 0; i < 2 * 78; i++)
        ids[i] = 7;
    dit_tensor pooled, hidden, out;
    const int64_t sp[2] = {2, 32}, sh[3] = {2, 78, 32};
    ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 2, sp, &pooled), DIT_OK);
    ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, sh, &hidden), DIT_OK);
    ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, sh, &out), DIT_OK);

    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_clip_text_forward(clip, arena, ids, 2, 78, &pooled, NULL, &diag),
                     DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "S <= 77"));
    ids[77 + 5] = 400;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_clip_text_forward(clip, arena, ids, 2, 77, &pooled, NULL, &diag),
                     DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "token id 400 at [1, 5]") != NULL, "%s", diag.msg);
    ids[77 + 5] = 7;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_clip_text_forward(clip, arena, ids, 2, 77, &pooled, &hidden, &diag),
                     DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "output 'hidden' is (2, 78, 32)") != NULL, "%s", diag.msg);

    ids[3] = -1;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_t5_encoder_forward(t5, arena, ids, 2, 78, &out, &diag),
                     DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "token id -1 at [0, 3]") != NULL, "%s", diag.msg);
    ids[3] = 7;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_t5_encoder_forward(t5, arena, ids, 2, 77, &out, &diag),
                     DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "expected (2, 77, 32)") != NULL, "%s", diag.msg);
    /* A valid call after the errors still works and leaves the arena's
     * scratch released. */
    const size_t before = dit_arena_high_water(arena);
    dit_diag_clear(&diag);
    ck_assert_msg(dit_t5_encoder_forward(t5, arena, ids, 2, 78, &out, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    ck_assert_uint_ge(dit_arena_high_water(arena), before);
    dit_clip_text_free(clip);
    dit_t5_encoder_free(t5);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("text_encoders");
    TCase *g = tcase_create("golden");
    tcase_add_checked_fixture(g, setup, teardown);
    tcase_set_timeout(g, 120);
    tcase_add_loop_test(g, clip_matches_transformers, 0, 2);
    tcase_add_loop_test(g, t5_matches_transformers, 0, 2);
    tcase_add_test(g, clip_tensor_name_prefixes);
    tcase_add_test(g, t5_tied_embedding_names);
    tcase_add_test(g, t5_buckets_match_pytorch);
    tcase_add_test(g, clip_eos_position_rules);
    suite_add_tcase(s, g);
    TCase *l = tcase_create("load_errors");
    tcase_add_checked_fixture(l, setup, teardown);
    tcase_add_test(l, clip_checkpoint_errors);
    tcase_add_test(l, clip_config_errors);
    tcase_add_test(l, t5_checkpoint_errors);
    tcase_add_test(l, t5_config_errors);
    tcase_add_test(l, forward_argument_errors);
    suite_add_tcase(s, l);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
