/* LoRA adapters (parallel/lora.h) against diffusers: the fixtures of
 * tests/golden/gen_lora_golden.py through the model interface in process
 * (one adapter per format, two at once, a subset, scale 0, diffusers'
 * adapter metadata, Wan), through
 * `ditrun forward` on meshes (tp 2, ring 2, tp 2 x ulysses 2; Wan on tp 2 x
 * ring 2) and through `ditrun generate` on the demo pipeline; the refusals
 * and their messages; switching adapters between forwards of one model.
 *
 * Every reference is checked to be far (> 100 x the tolerance) from the
 * base model's output, so a run that ignored the adapter would fail. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend.h"
#include "loader/safetensors.h"
#include "models/model.h"
#include "parallel/lora.h"
#include "runtime/inputs.h"
#include "runtime/runner.h"
#include "test_proc.h"

/* max |ours - diffusers| / max |diffusers|: f32 summation order only. */
#define FORWARD_TOL 1e-5
#define LATENTS_TOL 1e-4

static void data_path(char *buf, size_t cap, const char *rel)
{
    snprintf(buf, cap, "%s/tests/data/%s", test_env("DIT_SOURCE_ROOT"), rel);
}

/* A model of a golden case, its inputs, and a runner on one rank. */
typedef struct fixture {
    dit_backend *be;
    dit_model *model;
    dit_input_file *in;
    dit_runner *runner;
    dit_tensor out; /* host, f32 */
    float *out_data;
    dit_st_file *expected, *base;
} fixture;

static void fixture_open(fixture *f, const char *golden_case)
{
    char dir[1024], path[1100];
    dit_diag diag;
    dit_diag_clear(&diag);
    memset(f, 0, sizeof *f);
    data_path(dir, sizeof dir, golden_case);
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_msg(dit_backend_create(&bc, &f->be, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(path, sizeof path, "%s/transformer", dir);
    ck_assert_msg(dit_model_load(f->be, path, NULL, &f->model, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    snprintf(path, sizeof path, "%s/inputs.safetensors", dir);
    const void *cfg = dit_model_config(f->model);
    ck_assert_msg(dit_input_file_load(path, f->model->cls, cfg, &f->in, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    ck_assert_msg(dit_runner_create(f->be, f->model, NULL, &f->runner, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    ck_assert(f->model->cls->output_shape(cfg, dit_input_file_inputs(f->in), &f->out, &diag) ==
              DIT_OK);
    f->out_data = malloc((size_t)dit_tensor_numel(&f->out) * sizeof(float));
    ck_assert_ptr_nonnull(f->out_data);
    f->out.data = f->out_data;
    data_path(path, sizeof path, "lora/expected.safetensors");
    ck_assert_msg(dit_st_file_open(path, &f->expected, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(path, sizeof path, "%s/expected.safetensors", dir);
    ck_assert_msg(dit_st_file_open(path, &f->base, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
}

static void fixture_close(fixture *f)
{
    dit_runner_destroy(f->runner);
    dit_model_destroy(f->model);
    dit_input_file_free(f->in);
    dit_backend_destroy(f->be);
    dit_st_file_close(f->expected);
    dit_st_file_close(f->base);
    free(f->out_data);
}

static void forward(fixture *f)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_runner_forward(f->runner, dit_input_file_inputs(f->in), &f->out, &diag) ==
                      DIT_OK,
                  "%s", dit_diag_msg(&diag));
}

static dit_lora *load(fixture *f, const char *file)
{
    char path[1024];
    dit_diag diag;
    dit_diag_clear(&diag);
    data_path(path, sizeof path, file);
    dit_lora *l = NULL;
    ck_assert_msg(dit_lora_load(f->be, dit_model_lora_sites(f->model), path, 0, &l, &diag) ==
                      DIT_OK,
                  "%s", dit_diag_msg(&diag));
    return l;
}

static void attach(fixture *f, const dit_lora_use *uses, int n)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_lora_attach(dit_model_lora_sites(f->model), uses, n, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
}

/* The output against the reference `name` of lora/expected.safetensors,
 * which must itself be far from the base model's output. */
static void expect_reference(fixture *f, const char *name)
{
    const dit_st_entry *want = dit_st_file_find(f->expected, name);
    const dit_st_entry *base = dit_st_file_find(f->base, "sample");
    ck_assert_ptr_nonnull(want);
    ck_assert_ptr_nonnull(base);
    ck_assert(dit_tensor_same_shape(&want->view, &f->out));
    const test_err e = test_compare_views(&f->out, &want->view);
    const test_err from_base = test_compare_views(&base->view, &want->view);
    printf("%-13s vs diffusers %.3g (the adapter moves the output by %.3g)\n", name, e.rel,
           from_base.rel);
    fflush(stdout);
    ck_assert_msg(from_base.rel > 100 * FORWARD_TOL, "%s: reference too close to the base (%.3g)",
                  name, from_base.rel);
    ck_assert_msg(e.rel <= FORWARD_TOL, "%s: %.3g from diffusers", name, e.rel);
}

typedef struct ref_case {
    const char *name;
    const char *files[2];
    float scales[2];
    const char *golden;
} ref_case;

static const ref_case ref_cases[] = {
    {"peft", {"lora/peft.safetensors"}, {1.0f}, "golden/parallel_even"},
    {"kohya", {"lora/kohya.safetensors"}, {1.0f}, "golden/parallel_even"},
    {"two",
     {"lora/peft.safetensors", "lora/kohya.safetensors"},
     {0.7f, -0.4f},
     "golden/parallel_even"},
    {"subset", {"lora/subset.safetensors"}, {1.5f}, "golden/parallel_even"},
    {"kohya_linear1", {"lora/kohya_linear1.safetensors"}, {1.0f}, "golden/parallel_even"},
    {"meta", {"lora/meta.safetensors"}, {1.0f}, "golden/parallel_even"},
    {"wan", {"lora/wan_peft.safetensors"}, {0.9f}, "wan_golden/parallel_even"},
};

START_TEST(adapter_matches_diffusers)
{
    const ref_case *c = &ref_cases[_i];
    fixture f;
    fixture_open(&f, c->golden);
    dit_lora *l[2] = {NULL, NULL};
    dit_lora_use uses[2];
    int n = 0;
    for (; n < 2 && c->files[n]; n++) {
        l[n] = load(&f, c->files[n]);
        uses[n] = (dit_lora_use){.lora = l[n], .scale = c->scales[n]};
    }
    attach(&f, uses, n);
    forward(&f);
    expect_reference(&f, c->name);
    dit_lora_detach(dit_model_lora_sites(f.model));
    for (int i = 0; i < n; i++)
        dit_lora_destroy(l[i]);
    fixture_close(&f);
}
END_TEST

/* Base, adapter, base again, another adapter, scale 0: the model's weights
 * are never touched, so the base output comes back bit for bit. */
START_TEST(forwards_switch_adapters_without_touching_the_base)
{
    fixture f;
    fixture_open(&f, "golden/parallel_even");
    const size_t n = (size_t)dit_tensor_numel(&f.out);
    float *base = malloc(n * sizeof *base);
    ck_assert_ptr_nonnull(base);
    forward(&f);
    memcpy(base, f.out_data, n * sizeof *base);

    dit_lora *peft = load(&f, "lora/peft.safetensors");
    dit_lora *kohya = load(&f, "lora/kohya.safetensors");
    dit_lora_sites *sites = dit_model_lora_sites(f.model);
    attach(&f, &(dit_lora_use){peft, 1.0f}, 1);
    ck_assert(dit_lora_sites_active(sites));
    forward(&f);
    expect_reference(&f, "peft");
    dit_lora_detach(sites);
    ck_assert(!dit_lora_sites_active(sites));
    forward(&f);
    ck_assert_msg(memcmp(base, f.out_data, n * sizeof *base) == 0,
                  "the base output changed after a detach");
    /* Attaching replaces the attached set. */
    attach(&f, &(dit_lora_use){peft, 1.0f}, 1);
    attach(&f, &(dit_lora_use){kohya, 1.0f}, 1);
    forward(&f);
    expect_reference(&f, "kohya");
    attach(&f, &(dit_lora_use){kohya, 0.0f}, 1);
    forward(&f);
    ck_assert_msg(memcmp(base, f.out_data, n * sizeof *base) == 0, "scale 0 is not the base");
    dit_lora_detach(sites);
    dit_lora_destroy(peft);
    dit_lora_destroy(kohya);
    free(base);
    fixture_close(&f);
}
END_TEST

typedef struct refusal {
    const char *file;
    const char *golden;
    const char *needles[3];
} refusal;

static const refusal refusals[] = {
    {"lora/bad_unknown_key.safetensors",
     "golden/parallel_even",
     {"unknown key", "transformer.transformer_blocks.0.attn.to_k.lora_magnitude_vector"}},
    {"lora/bad_shape.safetensors",
     "golden/parallel_even",
     {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight", "7 input features", "takes 32"}},
    {"lora/bad_rank.safetensors",
     "golden/parallel_even",
     {"rank mismatch", "ff.net.0.proj.lora_A.weight", "rank 3"}},
    /* FLUX's adapter on a model without those blocks. */
    {"lora/peft.safetensors",
     "golden/double_only",
     {"the model has no linear 'single_transformer_blocks.0."}},
    /* kohya names mean nothing to Wan. */
    {"lora/kohya.safetensors", "wan_golden/parallel_even", {"kohya", "lora_unet_"}},
    /* Sizes that do not fit: FLUX's adapter on another FLUX. */
    {"lora/demo_peft.safetensors", "golden/parallel_even", {"input features"}},
};

START_TEST(bad_files_are_refused_naming_the_key)
{
    const refusal *r = &refusals[_i];
    fixture f;
    fixture_open(&f, r->golden);
    char path[1024];
    data_path(path, sizeof path, r->file);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_lora *l = NULL;
    const dit_status st = dit_lora_load(f.be, dit_model_lora_sites(f.model), path, 0, &l, &diag);
    ck_assert_msg(st != DIT_OK, "%s was accepted", r->file);
    ck_assert_ptr_null(l);
    for (int i = 0; i < 3 && r->needles[i]; i++)
        ck_assert_msg(strstr(dit_diag_msg(&diag), r->needles[i]), "message lacks '%s': %s",
                      r->needles[i], dit_diag_msg(&diag));
    /* Nothing attached: the base model. */
    ck_assert(!dit_lora_sites_active(dit_model_lora_sites(f.model)));
    fixture_close(&f);
}
END_TEST

/* Files a hostile or careless writer could put in --lora-dir, written here
 * as raw safetensors: the golden model's context_embedder is (32, 16) and
 * proj_out (8, 32). Each is refused with its reason, before anything is
 * attached. */
typedef struct raw_tensor {
    const char *name;
    int64_t rows, cols; /* cols 0: a scalar */
    float fill;
    long special_at; /* element set to `special` (-1: none) */
    float special;
} raw_tensor;

typedef struct hostile {
    const char *what;
    const char *metadata; /* the lora_adapter_metadata JSON text, or NULL */
    raw_tensor t[5];
    uint64_t max_bytes;
    const char *needle;
} hostile;

#define CE_A(r) "transformer.context_embedder.lora_A.weight", (r), 16
#define CE_B(r) "transformer.context_embedder.lora_B.weight", 32, (r)

static const hostile hostiles[] = {
    {"NaN alpha",
     NULL,
     {{CE_A(4), 0.01f, -1, 0},
      {CE_B(4), 0.01f, -1, 0},
      {"transformer.context_embedder.alpha", 0, 0, NAN, -1, 0}},
     0,
     "not a finite alpha"},
    {"fractional r",
     "{\"r\": 4.5, \"lora_alpha\": 4}",
     {{CE_A(4), 0.01f, -1, 0}, {CE_B(4), 0.01f, -1, 0}},
     0,
     "'r' must be a positive integer"},
    {"r beyond int",
     "{\"r\": 1e19, \"lora_alpha\": 4}",
     {{CE_A(4), 0.01f, -1, 0}, {CE_B(4), 0.01f, -1, 0}},
     0,
     "'r' must be a positive integer"},
    {"infinite lora_alpha",
     "{\"r\": 4, \"lora_alpha\": 1e400}",
     {{CE_A(4), 0.01f, -1, 0}, {CE_B(4), 0.01f, -1, 0}},
     0,
     "'lora_alpha' finite"},
    {"scaling past float",
     "{\"r\": 1, \"lora_alpha\": 1e300}",
     {{CE_A(1), 0.01f, -1, 0}, {CE_B(1), 0.01f, -1, 0}},
     0,
     "out of range"},
    {"B times its scaling overflows",
     "{\"r\": 1, \"lora_alpha\": 3e38}",
     {{CE_A(1), 0.01f, -1, 0}, {CE_B(1), 100.0f, -1, 0}},
     0,
     "overflows"},
    {"an infinite weight",
     NULL,
     {{CE_A(4), 0.01f, -1, 0}, {CE_B(4), 0.01f, 5, INFINITY}},
     0,
     "holds inf at element 5"},
    {"a NaN weight",
     NULL,
     {{CE_A(4), 0.01f, 63, NAN}, {CE_B(4), 0.01f, -1, 0}},
     0,
     "at element 63"},
    {"rank past what the linear can use",
     NULL,
     {{CE_A(17), 0.01f, -1, 0}, {CE_B(17), 0.01f, -1, 0}},
     0,
     "at most 16"},
    {"an alpha on one module only",
     NULL,
     {{CE_A(4), 0.01f, -1, 0},
      {CE_B(4), 0.01f, -1, 0},
      {"transformer.context_embedder.alpha", 0, 0, 2.0f, -1, 0},
      {"transformer.proj_out.lora_A.weight", 2, 32, 0.01f, -1, 0},
      {"transformer.proj_out.lora_B.weight", 8, 2, 0.01f, -1, 0}},
     0,
     "has an .alpha but"},
    {"over the file bound",
     NULL,
     {{CE_A(4), 0.01f, -1, 0}, {CE_B(4), 0.01f, -1, 0}},
     256,
     "over the limit of 256"},
};

/* Writes the tensors (F32) and metadata as a safetensors file. */
static void write_raw(const char *path, const hostile *h)
{
    char header[4096];
    size_t hl = (size_t)snprintf(header, sizeof header, "{");
    if (h->metadata) {
        hl += (size_t)snprintf(header + hl, sizeof header - hl,
                               "\"__metadata__\":{\"lora_adapter_metadata\":\"");
        for (const char *c = h->metadata; *c; c++) {
            if (*c == '"')
                header[hl++] = '\\';
            header[hl++] = *c;
        }
        hl += (size_t)snprintf(header + hl, sizeof header - hl, "\"},");
    }
    size_t off = 0;
    int nt = 0;
    for (; nt < 5 && h->t[nt].name; nt++) {
        const raw_tensor *t = &h->t[nt];
        const size_t n = t->cols ? (size_t)(t->rows * t->cols) : 1;
        char shape[64];
        if (t->cols)
            snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)t->rows, (long long)t->cols);
        else
            snprintf(shape, sizeof shape, "[]");
        hl +=
            (size_t)snprintf(header + hl, sizeof header - hl,
                             "%s\"%s\":{\"dtype\":\"F32\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                             nt ? "," : "", t->name, shape, off, off + 4 * n);
        off += 4 * n;
    }
    hl += (size_t)snprintf(header + hl, sizeof header - hl, "}");
    ck_assert_uint_lt(hl, sizeof header);
    FILE *fp = fopen(path, "wb");
    ck_assert_ptr_nonnull(fp);
    const uint64_t len = hl;
    ck_assert_uint_eq(fwrite(&len, 8, 1, fp), 1);
    ck_assert_uint_eq(fwrite(header, 1, hl, fp), hl);
    for (int i = 0; i < nt; i++) {
        const raw_tensor *t = &h->t[i];
        const long n = t->cols ? (long)(t->rows * t->cols) : 1;
        for (long k = 0; k < n; k++) {
            const float v = k == t->special_at ? t->special : t->fill;
            ck_assert_uint_eq(fwrite(&v, 4, 1, fp), 1);
        }
    }
    ck_assert_int_eq(fclose(fp), 0);
}

START_TEST(hostile_files_are_refused)
{
    const hostile *h = &hostiles[_i];
    fixture f;
    fixture_open(&f, "golden/parallel_even");
    char path[128];
    snprintf(path, sizeof path, "/tmp/dit_lora_hostile_%d_%d.safetensors", (int)getpid(), _i);
    write_raw(path, h);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_lora *l = NULL;
    const dit_status st =
        dit_lora_load(f.be, dit_model_lora_sites(f.model), path, h->max_bytes, &l, &diag);
    unlink(path);
    ck_assert_msg(st != DIT_OK, "%s: accepted", h->what);
    ck_assert_ptr_null(l);
    ck_assert_msg(strstr(dit_diag_msg(&diag), h->needle), "%s: message lacks '%s': %s", h->what,
                  h->needle, dit_diag_msg(&diag));
    ck_assert(!dit_lora_sites_active(dit_model_lora_sites(f.model)));
    fixture_close(&f);
}
END_TEST

/* The same file under a larger bound loads; a FIFO put where an adapter was
 * expected is refused at once (opening it does not wait for a writer). */
START_TEST(bound_and_fifo)
{
    fixture f;
    fixture_open(&f, "golden/parallel_even");
    char path[128];
    snprintf(path, sizeof path, "/tmp/dit_lora_fifo_%d.safetensors", (int)getpid());
    hostile ok = hostiles[10];
    ok.max_bytes = 1 << 20;
    write_raw(path, &ok);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_lora *l = NULL;
    ck_assert_msg(
        dit_lora_load(f.be, dit_model_lora_sites(f.model), path, ok.max_bytes, &l, &diag) == DIT_OK,
        "%s", dit_diag_msg(&diag));
    dit_lora_destroy(l);
    l = NULL;
    unlink(path);
    ck_assert_int_eq(mkfifo(path, 0600), 0);
    const dit_status st =
        dit_lora_load(f.be, dit_model_lora_sites(f.model), path, ok.max_bytes, &l, &diag);
    unlink(path);
    ck_assert_int_ne(st, DIT_OK);
    ck_assert_msg(strstr(dit_diag_msg(&diag), "not a regular file"), "%s", dit_diag_msg(&diag));
    fixture_close(&f);
}
END_TEST

/* Fusing merges the adapters into the weights: the same output, and no
 * fusing while adapters are attached. */
START_TEST(fused_adapters_match_diffusers)
{
    fixture f;
    fixture_open(&f, "golden/parallel_even");
    dit_lora *peft = load(&f, "lora/peft.safetensors");
    dit_lora *kohya = load(&f, "lora/kohya.safetensors");
    dit_lora_sites *sites = dit_model_lora_sites(f.model);
    dit_diag diag;
    dit_diag_clear(&diag);
    attach(&f, &(dit_lora_use){peft, 1.0f}, 1);
    ck_assert_int_ne(dit_lora_fuse(sites, peft, 0.7f, &diag), DIT_OK);
    ck_assert_msg(strstr(dit_diag_msg(&diag), "detach"), "%s", dit_diag_msg(&diag));
    dit_lora_detach(sites);
    dit_diag_clear(&diag);
    ck_assert_msg(dit_lora_fuse(sites, peft, 0.7f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_msg(dit_lora_fuse(sites, kohya, -0.4f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_lora_destroy(peft);
    dit_lora_destroy(kohya);
    ck_assert(!dit_lora_sites_active(sites));
    forward(&f);
    expect_reference(&f, "two");
    fixture_close(&f);
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Through ditrun, on meshes                                                 */

typedef struct mesh_case {
    const char *name;
    const char *args[8];
} mesh_case;

static const mesh_case meshes[] = {
    {"one rank", {NULL}},
    {"tp 2", {"--world-size", "2", "--tp", "2"}},
    {"ring 2", {"--world-size", "2", "--ring", "2"}},
    {"tp 2 x ulysses 2", {"--world-size", "4", "--tp", "2", "--ulysses", "2"}},
    /* Merged into the weights at load instead (forward only). */
    {"one rank, fused", {"--fuse-lora"}},
    {"tp 2, fused", {"--world-size", "2", "--tp", "2", "--fuse-lora"}},
};

START_TEST(ditrun_forward_on_meshes_matches_diffusers)
{
    const mesh_case *m = &meshes[_i];
    char model[1024], inputs[1024], peft[1100], kohya[1100], out[128], exp[1024], log[16384];
    data_path(model, sizeof model, "golden/parallel_even/transformer");
    data_path(inputs, sizeof inputs, "golden/parallel_even/inputs.safetensors");
    data_path(exp, sizeof exp, "lora/expected.safetensors");
    data_path(peft, sizeof peft, "lora/peft.safetensors");
    data_path(kohya, sizeof kohya, "lora/kohya.safetensors");
    strcat(peft, ":0.7");
    strcat(kohya, ":-0.4");
    snprintf(out, sizeof out, "/tmp/dit_lora_fwd_%d_%d.safetensors", (int)getpid(), _i);
    char *argv[32] = {(char *)test_env("DITRUN"),
                      "forward",
                      "--model",
                      model,
                      "--inputs",
                      inputs,
                      "--output",
                      out,
                      "--lora",
                      peft,
                      "--lora",
                      kohya,
                      "--quiet"};
    int k = 13;
    for (int i = 0; m->args[i]; i++)
        argv[k++] = (char *)m->args[i];
    argv[k] = NULL;
    const int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "%s: ditrun exited %d:\n%s", m->name, rc, log);
    const test_err e = test_compare_files(out, "sample", exp, "two");
    printf("forward, %-18s two adapters vs diffusers %.3g\n", m->name, e.rel);
    fflush(stdout);
    ck_assert_msg(e.rel <= FORWARD_TOL, "%s: %.3g from diffusers", m->name, e.rel);
    unlink(out);
}
END_TEST

/* Wan through the same generic path on a mesh that splits its weights and
 * its video tokens. */
START_TEST(ditrun_forward_wan_on_tp_and_ring_matches_diffusers)
{
    char model[1024], inputs[1024], lora[1100], out[128], exp[1024], log[16384];
    data_path(model, sizeof model, "wan_golden/parallel_even/transformer");
    data_path(inputs, sizeof inputs, "wan_golden/parallel_even/inputs.safetensors");
    data_path(exp, sizeof exp, "lora/expected.safetensors");
    data_path(lora, sizeof lora, "lora/wan_peft.safetensors");
    strcat(lora, ":0.9");
    snprintf(out, sizeof out, "/tmp/dit_lora_wan_%d.safetensors", (int)getpid());
    char *argv[] = {(char *)test_env("DITRUN"),
                    "forward",
                    "--model",
                    model,
                    "--inputs",
                    inputs,
                    "--output",
                    out,
                    "--lora",
                    lora,
                    "--world-size",
                    "4",
                    "--tp",
                    "2",
                    "--ring",
                    "2",
                    "--quiet",
                    NULL};
    const int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "ditrun exited %d:\n%s", rc, log);
    const test_err e = test_compare_files(out, "sample", exp, "wan");
    printf("forward, wan tp 2 x ring 2  vs diffusers %.3g\n", e.rel);
    fflush(stdout);
    ck_assert_msg(e.rel <= FORWARD_TOL, "%.3g from diffusers", e.rel);
    unlink(out);
}
END_TEST

START_TEST(ditrun_generate_matches_diffusers)
{
    const mesh_case *m = &meshes[_i];
    char model[1024], lora[1100], lat[128], png[128], ref[1024], base[1024], log[16384];
    data_path(model, sizeof model, "demo");
    data_path(lora, sizeof lora, "lora/demo_peft.safetensors");
    strcat(lora, ":0.8");
    data_path(ref, sizeof ref, "lora/demo_reference.safetensors");
    data_path(base, sizeof base, "pipeline_golden/square_2steps/reference.safetensors");
    snprintf(lat, sizeof lat, "/tmp/dit_lora_gen_%d_%d.safetensors", (int)getpid(), _i);
    snprintf(png, sizeof png, "/tmp/dit_lora_gen_%d_%d.png", (int)getpid(), _i);
    /* The request of pipeline_golden/square_2steps. */
    char *argv[40] = {(char *)test_env("DITRUN"),
                      "generate",
                      "--model",
                      model,
                      "--prompt",
                      "a red fox in the snow",
                      "--width",
                      "64",
                      "--height",
                      "64",
                      "--steps",
                      "2",
                      "--guidance",
                      "3.5",
                      "--seed",
                      "1",
                      "--output",
                      png,
                      "--output-latents",
                      lat,
                      "--lora",
                      lora,
                      "--quiet"};
    int k = 23;
    for (int i = 0; m->args[i]; i++)
        argv[k++] = (char *)m->args[i];
    argv[k] = NULL;
    const int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "%s: ditrun exited %d:\n%s", m->name, rc, log);
    const test_err e = test_compare_files(lat, "latents", ref, "final_latents");
    const test_err from_base = test_compare_files(base, "final_latents", ref, "final_latents");
    printf("generate, %-17s latents vs diffusers %.3g (the adapter moves them by %.3g)\n", m->name,
           e.rel, from_base.rel);
    fflush(stdout);
    ck_assert_msg(from_base.rel > 100 * LATENTS_TOL, "reference too close to the base");
    ck_assert_msg(e.rel <= LATENTS_TOL, "%s: %.3g from diffusers", m->name, e.rel);
    unlink(lat);
    unlink(png);
}
END_TEST

START_TEST(ditrun_reports_a_refused_adapter)
{
    char model[1024], inputs[1024], bad[1100], log[16384];
    data_path(model, sizeof model, "golden/parallel_even/transformer");
    data_path(inputs, sizeof inputs, "golden/parallel_even/inputs.safetensors");
    data_path(bad, sizeof bad, "lora/bad_rank.safetensors");
    char *argv[] = {(char *)test_env("DITRUN"),
                    "forward",
                    "--model",
                    model,
                    "--inputs",
                    inputs,
                    "--output",
                    "/tmp/dit_lora_never.safetensors",
                    "--lora",
                    bad,
                    "--world-size",
                    "2",
                    "--tp",
                    "2",
                    NULL};
    const int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_int_ne(rc, 0);
    ck_assert_msg(strstr(log, "rank mismatch"), "no reason given:\n%s", log);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("lora");
    TCase *tc = tcase_create("diffusers");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, adapter_matches_diffusers, 0,
                        (int)(sizeof ref_cases / sizeof ref_cases[0]));
    tcase_add_test(tc, forwards_switch_adapters_without_touching_the_base);
    tcase_add_test(tc, fused_adapters_match_diffusers);
    tcase_add_loop_test(tc, bad_files_are_refused_naming_the_key, 0,
                        (int)(sizeof refusals / sizeof refusals[0]));
    tcase_add_loop_test(tc, hostile_files_are_refused, 0,
                        (int)(sizeof hostiles / sizeof hostiles[0]));
    tcase_add_test(tc, bound_and_fifo);
    suite_add_tcase(s, tc);
    TCase *tr = tcase_create("ditrun");
    tcase_set_timeout(tr, 900);
    tcase_add_loop_test(tr, ditrun_forward_on_meshes_matches_diffusers, 0,
                        (int)(sizeof meshes / sizeof meshes[0]));
    tcase_add_test(tr, ditrun_forward_wan_on_tp_and_ring_matches_diffusers);
    tcase_add_loop_test(tr, ditrun_generate_matches_diffusers, 0, 3);
    tcase_add_test(tr, ditrun_reports_a_refused_adapter);
    suite_add_tcase(s, tr);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
