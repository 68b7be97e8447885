/* cuda backend: attention on cuDNN's fused scaled-dot-product-attention
 * forward (DIT_CUDA_ATTN=cudnn).
 *
 * cuDNN 9.13.1 and later have one backend operation for the whole of it
 * (CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR: Q, K, V, O, the optional
 * softmax statistics and a by-value scale), which its "unified SDPA"
 * runtime-fusion engine runs as a flash-attention kernel (TMA and wgmma on
 * Hopper). The statistics are max + ln(sum exp(s - max)) of the scaled
 * scores per query row, (B, H, Sq, 1) f32: exactly the natural-log LSE that
 * the attention op writes and ring attention merges.
 *
 * The library is optional at run time: it is dlopen'ed ("libcudnn.so.9")
 * the first time a backend wants it, so a worker built here runs on a
 * machine without cuDNN and only DIT_CUDA_ATTN=cudnn then fails, saying so.
 * Only the header is needed to build (DIT_HAVE_CUDNN). Per shape (sizes and
 * strides, with or without statistics) the heuristic's engine configs are
 * tried in order and the first that finalises is kept; a shape with none
 * is remembered as unsupported and runs on v1 (counted, one warning on
 * stderr). Plans are made only outside graph capture; a captured call
 * replays the plan its eager pass made.
 *
 * Owner: the backend's thread, like every backend op. */
#include <cstdarg>
#include <cstdlib>

#include "backend/cuda/cuda_internal.cuh"

#ifdef DIT_HAVE_CUDNN

#include <cudnn_graph.h>
#include <dlfcn.h>

/* The runtime version that has the SDPA forward operation with Q, K, V, O,
 * statistics and scale (cudnn_graph_v9.h: "since 9.13.0"; NVIDIA's own
 * frontend asks for 9.13.1 before using it). */
enum { CUDNN_SDPA_MIN_VERSION = 91301 };

/* Tensor ids of the variant pack. */
enum { UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE };

/* Engine configs tried per shape. */
enum { CUDNN_MAX_CFGS = 16 };

struct cudnn_fns {
    decltype(&cudnnGetVersion) GetVersion;
    decltype(&cudnnGetErrorString) GetErrorString;
    decltype(&cudnnGetLastErrorString) GetLastErrorString;
    decltype(&cudnnCreate) Create;
    decltype(&cudnnDestroy) Destroy;
    decltype(&cudnnSetStream) SetStream;
    decltype(&cudnnBackendCreateDescriptor) CreateDescriptor;
    decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor;
    decltype(&cudnnBackendSetAttribute) SetAttribute;
    decltype(&cudnnBackendGetAttribute) GetAttribute;
    decltype(&cudnnBackendFinalize) Finalize;
    decltype(&cudnnBackendExecute) Execute;
};

/* One shape's plan. The descriptors it was made from stay alive with it. */
struct cudnn_plan {
    /* key: q, k, v, o as cuDNN sees them, (B, H, S, D) sizes and strides in
     * elements (the last stride is 1) */
    int64_t dim[4][4];
    int64_t st[4][4];
    bool stats;
    /* value */
    bool ok; /* false: cuDNN has no plan for the shape; it runs on v1 */
    cudnnBackendDescriptor_t desc[9 + CUDNN_MAX_CFGS]; /* PD_* slots */
    cudnnBackendDescriptor_t plan;
    int64_t workspace;
};

struct cuda_cudnn {
    void *lib;
    cudnn_fns f;
    cudnnHandle_t h;
    size_t version;
    bool loaded;   /* lib, f, h usable */
    bool failed;   /* loading failed; why says how */
    bool warned;   /* the failure was printed */
    char why[384]; /* the last failure: loading, or the last shape's plan */
    cudnn_plan *plans;
    size_t n_plans, cap_plans;
};

/* Records "what: cuDNN's message (its last error)" in dnn->why. */
static void cudnn_why(cuda_cudnn *dnn, cudnnStatus_t s, const char *what)
{
    char last[256] = "";
    if (dnn->f.GetLastErrorString)
        dnn->f.GetLastErrorString(last, sizeof last);
    snprintf(dnn->why, sizeof dnn->why, "%s: %s%s%s", what,
             dnn->f.GetErrorString ? dnn->f.GetErrorString(s) : "cuDNN error", last[0] ? ": " : "",
             last);
}

#define DNN_TRY(dnn, what, call)                                                                   \
    do {                                                                                           \
        const cudnnStatus_t s_ = (call);                                                           \
        if (s_ != CUDNN_STATUS_SUCCESS) {                                                          \
            cudnn_why((dnn), s_, (what));                                                          \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

static void *cudnn_sym(cuda_cudnn *dnn, const char *name)
{
    void *p = dlsym(dnn->lib, name);
    if (!p && !dnn->why[0])
        snprintf(dnn->why, sizeof dnn->why, "libcudnn.so.9 has no %s", name);
    return p;
}

/* dlopen's libcudnn.so.9 and finds its functions; false with dnn->why
 * when it cannot or the version is too old. Needs no device. */
static bool cudnn_dl(cuda_cudnn *dnn)
{
    dnn->lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!dnn->lib) {
        const char *e = dlerror();
        snprintf(dnn->why, sizeof dnn->why, "cannot load libcudnn.so.9 (%s)", e ? e : "?");
        return false;
    }
#define DNN_SYM(field, name)                                                                       \
    if (!(dnn->f.field = (decltype(dnn->f.field))cudnn_sym(dnn, name)))                            \
    return false
    DNN_SYM(GetVersion, "cudnnGetVersion");
    DNN_SYM(GetErrorString, "cudnnGetErrorString");
    DNN_SYM(GetLastErrorString, "cudnnGetLastErrorString");
    DNN_SYM(Create, "cudnnCreate");
    DNN_SYM(Destroy, "cudnnDestroy");
    DNN_SYM(SetStream, "cudnnSetStream");
    DNN_SYM(CreateDescriptor, "cudnnBackendCreateDescriptor");
    DNN_SYM(DestroyDescriptor, "cudnnBackendDestroyDescriptor");
    DNN_SYM(SetAttribute, "cudnnBackendSetAttribute");
    DNN_SYM(GetAttribute, "cudnnBackendGetAttribute");
    DNN_SYM(Finalize, "cudnnBackendFinalize");
    DNN_SYM(Execute, "cudnnBackendExecute");
#undef DNN_SYM
    dnn->version = dnn->f.GetVersion();
    if (dnn->version < CUDNN_SDPA_MIN_VERSION) {
        snprintf(dnn->why, sizeof dnn->why,
                 "cuDNN %zu.%zu.%zu has no SDPA forward operation (it needs 9.13.1 or newer)",
                 dnn->version / 10000, dnn->version / 100 % 100, dnn->version % 100);
        return false;
    }
    return true;
}

/* Destroys the handle. The library stays mapped (cuDNN dlopen's its own
 * sub-libraries, and its kernels may back graphs elsewhere in the
 * process): dlclose only undoes a load that never got as far as a handle. */
static void cudnn_close(cuda_cudnn *dnn)
{
    const bool used = dnn->h != NULL;
    if (dnn->h && dnn->f.Destroy)
        dnn->f.Destroy(dnn->h);
    dnn->h = NULL;
    if (dnn->lib && !used)
        dlclose(dnn->lib);
    dnn->lib = NULL;
    memset(&dnn->f, 0, sizeof dnn->f);
    dnn->loaded = false;
}

/* Loads the library and makes a handle on cb's stream, once. DIT_OK when
 * usable; DIT_ERR_UNSUPPORTED (with dnn->why) when not, then and on every
 * later call. */
static dit_status cudnn_load(dit_cuda_backend *cb)
{
    if (!cb->dnn) {
        cb->dnn = (cuda_cudnn *)calloc(1, sizeof *cb->dnn);
        if (!cb->dnn)
            return dit_cuda_bad(cb, DIT_ERR_NOMEM, "cudnn", "out of memory");
    }
    cuda_cudnn *dnn = cb->dnn;
    if (dnn->loaded)
        return DIT_OK;
    if (dnn->failed)
        return DIT_ERR_UNSUPPORTED;
    cudnnStatus_t s;
    if (!cudnn_dl(dnn))
        goto fail;
    if ((s = dnn->f.Create(&dnn->h)) != CUDNN_STATUS_SUCCESS) {
        dnn->h = NULL;
        cudnn_why(dnn, s, "cudnnCreate");
        goto fail;
    }
    if ((s = dnn->f.SetStream(dnn->h, cb->stream)) != CUDNN_STATUS_SUCCESS) {
        cudnn_why(dnn, s, "cudnnSetStream");
        goto fail;
    }
    dnn->loaded = true;
    return DIT_OK;
fail:
    dnn->failed = true;
    cudnn_close(dnn);
    return DIT_ERR_UNSUPPORTED;
}

/* A finalised tensor descriptor. */
static cudnnStatus_t cudnn_tensor(cuda_cudnn *dnn, cudnnBackendDescriptor_t *out, int64_t uid,
                                  cudnnDataType_t dt, int nd, const int64_t *dims,
                                  const int64_t *strides, bool by_value)
{
    cudnnBackendDescriptor_t t = NULL;
    const int64_t align = 16;
    cudnnStatus_t s = dnn->f.CreateDescriptor(CUDNN_BACKEND_TENSOR_DESCRIPTOR, &t);
    if (s != CUDNN_STATUS_SUCCESS)
        return s;
    if ((s = dnn->f.SetAttribute(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt)) ||
        (s = dnn->f.SetAttribute(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, nd, dims)) ||
        (s = dnn->f.SetAttribute(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, nd, strides)) ||
        (s = dnn->f.SetAttribute(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)) ||
        (s = dnn->f.SetAttribute(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1,
                                 &align)) ||
        (by_value && (s = dnn->f.SetAttribute(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN,
                                              1, &by_value))) ||
        (s = dnn->f.Finalize(t))) {
        dnn->f.DestroyDescriptor(t);
        return s;
    }
    *out = t;
    return CUDNN_STATUS_SUCCESS;
}

static void plan_release(cuda_cudnn *dnn, cudnn_plan *p)
{
    if (p->plan)
        dnn->f.DestroyDescriptor(p->plan);
    for (size_t i = 0; i < sizeof p->desc / sizeof p->desc[0]; i++)
        if (p->desc[i])
            dnn->f.DestroyDescriptor(p->desc[i]);
    p->plan = NULL;
    memset(p->desc, 0, sizeof p->desc);
}

/* Descriptor slots of a plan: the tensors, the operation, the graph, the
 * heuristic, then its engine configs. */
enum { PD_Q = 0, PD_K, PD_V, PD_O, PD_STATS, PD_SCALE, PD_OP, PD_GRAPH, PD_HEUR, PD_CFG0 };

/* The tensors and the finalised SDPA operation of p's key into p->desc
 * (PD_Q .. PD_OP); false with dnn->why when cuDNN refuses them. Needs no
 * device. scale_nd: the scale tensor as 4-D (1, 1, 1, 1) or 1-D (1). */
static bool op_make(cuda_cudnn *dnn, cudnn_plan *p, int scale_nd)
{
    const int64_t B = p->dim[0][0], H = p->dim[0][1], Sq = p->dim[0][2];
    cudnnBackendDescriptor_t *d = p->desc;
    const cudnnDataType_t bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    const int64_t ds[4] = {B, H, Sq, 1}, ss[4] = {H * Sq, Sq, 1, 1};
    const int64_t one[4] = {1, 1, 1, 1};
    static const cudnnBackendAttributeName_t roles[4] = {
        CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC,
        CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC};
    static const char *const names[4] = {"Q", "K", "V", "O"};
    char what[64];
    for (int i = 0; i < 4; i++) {
        snprintf(what, sizeof what, "%s tensor", names[i]);
        DNN_TRY(dnn, what,
                cudnn_tensor(dnn, &d[PD_Q + i], UID_Q + i, bf, 4, p->dim[i], p->st[i], false));
    }
    if (p->stats)
        DNN_TRY(dnn, "stats tensor",
                cudnn_tensor(dnn, &d[PD_STATS], UID_STATS, f32, 4, ds, ss, false));
    DNN_TRY(dnn, "scale tensor",
            cudnn_tensor(dnn, &d[PD_SCALE], UID_SCALE, f32, scale_nd, one, one, true));
    DNN_TRY(dnn, "SDPA operation",
            dnn->f.CreateDescriptor(CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR, &d[PD_OP]));
    for (int i = 0; i < 4; i++) {
        snprintf(what, sizeof what, "SDPA %s", names[i]);
        DNN_TRY(dnn, what,
                dnn->f.SetAttribute(d[PD_OP], roles[i], CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                    &d[PD_Q + i]));
    }
    if (p->stats)
        DNN_TRY(dnn, "SDPA stats",
                dnn->f.SetAttribute(d[PD_OP], CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d[PD_STATS]));
    DNN_TRY(dnn, "SDPA scale",
            dnn->f.SetAttribute(d[PD_OP], CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC,
                                CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d[PD_SCALE]));
    DNN_TRY(dnn, "SDPA operation finalize", dnn->f.Finalize(d[PD_OP]));
    return true;
fail:
    return false;
}

/* Makes p's plan (p's key filled in); false with dnn->why when cuDNN has
 * none, every descriptor released. */
static bool plan_make(cuda_cudnn *dnn, cudnn_plan *p, int scale_nd)
{
    cudnnBackendDescriptor_t *d = p->desc;
    cudnnBackendDescriptor_t *cfgs = &p->desc[PD_CFG0];
    cudnnBackendDescriptor_t &op = d[PD_OP], &graph = d[PD_GRAPH], &heur = d[PD_HEUR];
    int64_t n_cfg = 0;
    const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    dnn->why[0] = '\0';
    memset(p->desc, 0, sizeof p->desc);
    p->plan = NULL;
    if (!op_make(dnn, p, scale_nd))
        goto fail;
    DNN_TRY(dnn, "operation graph",
            dnn->f.CreateDescriptor(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &graph));
    DNN_TRY(dnn, "operation graph handle",
            dnn->f.SetAttribute(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                &dnn->h));
    DNN_TRY(dnn, "operation graph ops",
            dnn->f.SetAttribute(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                1, &op));
    DNN_TRY(dnn, "operation graph finalize", dnn->f.Finalize(graph));

    /* The heuristic's configs in its order, mode A first, then the
     * fallback list; the first config that finalises into a plan wins. */
    for (int m = 0; m < 2 && !p->plan; m++) {
        if (heur)
            dnn->f.DestroyDescriptor(heur);
        heur = NULL;
        for (int i = 0; i < CUDNN_MAX_CFGS; i++)
            if (cfgs[i])
                dnn->f.DestroyDescriptor(cfgs[i]);
        memset(cfgs, 0, CUDNN_MAX_CFGS * sizeof *cfgs);
        DNN_TRY(dnn, "engine heuristic",
                dnn->f.CreateDescriptor(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur));
        DNN_TRY(dnn, "engine heuristic graph",
                dnn->f.SetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph));
        DNN_TRY(dnn, "engine heuristic mode",
                dnn->f.SetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1,
                                    &modes[m]));
        cudnnStatus_t hs = dnn->f.Finalize(heur);
        if (hs != CUDNN_STATUS_SUCCESS) {
            cudnn_why(dnn, hs, "engine heuristic finalize");
            continue;
        }
        int64_t avail = 0;
        hs = dnn->f.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                 0, &avail, NULL);
        if (hs != CUDNN_STATUS_SUCCESS) {
            cudnn_why(dnn, hs, "engine heuristic result count");
            continue;
        }
        if (avail <= 0)
            continue;
        const int64_t want = avail < (int64_t)CUDNN_MAX_CFGS ? avail : (int64_t)CUDNN_MAX_CFGS;
        for (int64_t i = 0; i < want; i++)
            DNN_TRY(dnn, "engine config",
                    dnn->f.CreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfgs[i]));
        DNN_TRY(dnn, "engine heuristic results",
                dnn->f.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, want, &n_cfg, cfgs));
        for (int64_t i = 0; i < n_cfg && i < want && !p->plan; i++) {
            cudnnBackendDescriptor_t plan = NULL;
            cudnnStatus_t s =
                dnn->f.CreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan);
            if (s == CUDNN_STATUS_SUCCESS)
                s = dnn->f.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE,
                                        1, &dnn->h);
            if (s == CUDNN_STATUS_SUCCESS)
                s = dnn->f.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                        CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
            if (s == CUDNN_STATUS_SUCCESS)
                s = dnn->f.Finalize(plan);
            int64_t got = 0;
            if (s == CUDNN_STATUS_SUCCESS)
                s = dnn->f.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                        CUDNN_TYPE_INT64, 1, &got, &p->workspace);
            if (s == CUDNN_STATUS_SUCCESS && p->workspace >= 0) {
                p->plan = plan;
            } else {
                if (s == CUDNN_STATUS_SUCCESS)
                    snprintf(dnn->why, sizeof dnn->why, "execution plan: workspace size %lld",
                             (long long)p->workspace);
                else
                    cudnn_why(dnn, s, "execution plan");
                if (plan)
                    dnn->f.DestroyDescriptor(plan);
            }
        }
    }
    if (!p->plan) {
        if (!dnn->why[0])
            snprintf(dnn->why, sizeof dnn->why, "the engine heuristic offered no configuration");
        goto fail;
    }
    return true; /* every descriptor is kept with the plan */
fail:
    plan_release(dnn, p);
    return false;
}

static bool plan_key_eq(const cudnn_plan *a, const cudnn_plan *b)
{
    return a->stats == b->stats && memcmp(a->dim, b->dim, sizeof a->dim) == 0 &&
           memcmp(a->st, b->st, sizeof a->st) == 0;
}

/* The cached plan of key's shape, made on first use; NULL on memory
 * failure. */
static cudnn_plan *plan_get(dit_cuda_backend *cb, const cudnn_plan *key)
{
    cuda_cudnn *dnn = cb->dnn;
    for (size_t i = 0; i < dnn->n_plans; i++)
        if (plan_key_eq(&dnn->plans[i], key))
            return &dnn->plans[i];
    if (cb->capturing)
        return NULL;
    if (dnn->n_plans == dnn->cap_plans) {
        const size_t cap = dnn->cap_plans ? 2 * dnn->cap_plans : 16;
        cudnn_plan *np = (cudnn_plan *)realloc(dnn->plans, cap * sizeof *np);
        if (!np)
            return NULL;
        dnn->plans = np;
        dnn->cap_plans = cap;
    }
    cudnn_plan *p = &dnn->plans[dnn->n_plans++];
    *p = *key;
    p->ok = plan_make(dnn, p, 1) || plan_make(dnn, p, 4);
    cb->stats.cudnn_shapes++;
    if (!p->ok) {
        cb->stats.cudnn_unsupported_shapes++;
        fprintf(stderr,
                "cuda backend: cuDNN has no SDPA plan for B %lld, H %lld, Sq %lld, Skv %lld, "
                "D %lld%s (%s); this shape runs on v1\n",
                (long long)p->dim[0][0], (long long)p->dim[0][1], (long long)p->dim[0][2],
                (long long)p->dim[1][2], (long long)p->dim[0][3],
                p->stats ? " with statistics" : "", dnn->why);
    }
    return p;
}

/* The plan key of a call: sizes, and the (B, S, H) byte strides of each
 * (B, S, H, D) tensor as cuDNN's (B, H, S) element strides. */
static void key_of(cudnn_plan *key, const dit_tensor *out, const dit_tensor *lse,
                   const dit_tensor *q, const dit_tensor *k, const dit_tensor *v)
{
    memset(key, 0, sizeof *key);
    key->stats = lse != NULL;
    const dit_tensor *t[4] = {q, k, v, out};
    for (int i = 0; i < 4; i++) {
        key->dim[i][0] = t[i]->ne[0], key->st[i][0] = t[i]->nb[0] / 2;
        key->dim[i][1] = t[i]->ne[2], key->st[i][1] = t[i]->nb[2] / 2;
        key->dim[i][2] = t[i]->ne[1], key->st[i][2] = t[i]->nb[1] / 2;
        key->dim[i][3] = t[i]->ne[3], key->st[i][3] = t[i]->nb[3] / 2;
    }
}

bool dit_cuda_cudnn_eligible(const dit_tensor *out, const dit_tensor *lse, const dit_tensor *q,
                             const dit_tensor *k, const dit_tensor *v)
{
    /* Every tensor is declared 16-byte aligned to cuDNN. */
    if (lse && (uintptr_t)lse->data % 16 != 0)
        return false;
    const dit_tensor *t[4] = {q, k, v, out};
    for (int i = 0; i < 4; i++)
        if (t[i]->dtype != DIT_BF16 || t[i]->nb[3] != 2 || (uintptr_t)t[i]->data % 16 != 0 ||
            t[i]->nb[0] % 16 != 0 || t[i]->nb[1] % 16 != 0 || t[i]->nb[2] % 16 != 0)
            return false;
    /* cuDNN wants head dims in multiples of 8 (these are 64 and 128) and
     * non-empty sequences; a 1 x 1 attention is a known gap of its
     * kernels. */
    return q->ne[3] % 8 == 0 && q->ne[1] >= 1 && k->ne[1] >= 1 && q->ne[1] + k->ne[1] > 2;
}

dit_status dit_cuda_cudnn_attention(dit_cuda_backend *cb, const char *op, const dit_tensor *out,
                                    const dit_tensor *lse, const dit_tensor *q, const dit_tensor *k,
                                    const dit_tensor *v, float scale, bool *ran)
{
    *ran = false;
    if (!(cb->dnn && cb->dnn->loaded)) {
        if (cb->capturing || cudnn_load(cb) != DIT_OK) {
            cb->stats.attn_cudnn_fallback_calls++;
            if (cb->dnn && cb->dnn->failed && !cb->dnn->warned) {
                fprintf(stderr, "cuda backend: DIT_CUDA_ATTN=cudnn: %s; attention runs on v1\n",
                        cb->dnn->why);
                cb->dnn->warned = true;
            }
            /* Not capturing and no dnn: cudnn_load recorded the NOMEM. */
            return cb->capturing || cb->dnn ? DIT_OK : DIT_ERR_NOMEM;
        }
    }
    cuda_cudnn *dnn = cb->dnn;
    cudnn_plan key;
    key_of(&key, out, lse, q, k, v);
    cudnn_plan *p = plan_get(cb, &key);
    if (!p && !cb->capturing)
        return dit_cuda_bad(cb, DIT_ERR_NOMEM, op, "cudnn plan cache: out of memory");
    if (!p || !p->ok) {
        cb->stats.attn_cudnn_fallback_calls++;
        return DIT_OK;
    }
    void *ws = NULL;
    if (p->workspace > 0)
        DIT_CHECK_RET(dit_cuda_scratch(cb, CUDA_SCRATCH_CUDNN, (size_t)p->workspace, &ws, op));
    float scale_v = scale;
    int64_t uids[6] = {UID_Q, UID_K, UID_V, UID_O, UID_SCALE, UID_STATS};
    void *ptrs[6] = {q->data, k->data, v->data, out->data, &scale_v, lse ? lse->data : NULL};
    const int64_t n = lse ? 6 : 5;
    cudnnBackendDescriptor_t pack = NULL;
    DNN_TRY(dnn, "variant pack",
            dnn->f.CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
    DNN_TRY(
        dnn, "variant pack ids",
        dnn->f.SetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids));
    DNN_TRY(dnn, "variant pack pointers",
            dnn->f.SetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                                ptrs));
    DNN_TRY(
        dnn, "variant pack workspace",
        dnn->f.SetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws));
    DNN_TRY(dnn, "variant pack finalize", dnn->f.Finalize(pack));
    DNN_TRY(dnn, "cudnnBackendExecute", dnn->f.Execute(dnn->h, p->plan, pack));
    dnn->f.DestroyDescriptor(pack);
    cb->stats.attn_cudnn_calls++;
    *ran = true;
    return DIT_OK;
fail:
    if (pack)
        dnn->f.DestroyDescriptor(pack);
    return dit_cuda_bad(cb, DIT_ERR_DEVICE, op, "cudnn: %s", dnn->why);
}

dit_status dit_cuda_cudnn_open(dit_cuda_backend *cb, char *why, size_t n)
{
    const dit_status st = cudnn_load(cb);
    if (st == DIT_OK)
        snprintf(why, n, "cuDNN %zu.%zu.%zu", cb->dnn->version / 10000,
                 cb->dnn->version / 100 % 100, cb->dnn->version % 100);
    else
        snprintf(why, n, "%s", cb->dnn ? cb->dnn->why : "out of memory");
    return st;
}

extern "C" dit_status dit_cudnn_sdpa_check(const dit_tensor *out, const dit_tensor *lse,
                                           const dit_tensor *q, const dit_tensor *k,
                                           const dit_tensor *v, char *why, size_t n)
{
    cuda_cudnn *dnn = (cuda_cudnn *)calloc(1, sizeof *dnn);
    cudnn_plan *p = (cudnn_plan *)calloc(1, sizeof *p);
    dit_status st = DIT_ERR_NOMEM;
    snprintf(why, n, "out of memory");
    if (!dnn || !p)
        goto done;
    st = DIT_ERR_UNSUPPORTED;
    if (!cudnn_dl(dnn)) {
        snprintf(why, n, "%s", dnn->why);
        goto done;
    }
    key_of(p, out, lse, q, k, v);
    if (op_make(dnn, p, 4)) {
        st = DIT_OK;
        snprintf(why, n, "cuDNN %zu.%zu.%zu took it", dnn->version / 10000,
                 dnn->version / 100 % 100, dnn->version % 100);
    } else {
        st = DIT_ERR_INVALID_ARG;
        snprintf(why, n, "%s", dnn->why);
    }
    plan_release(dnn, p);
done:
    if (dnn)
        cudnn_close(dnn);
    free(p);
    free(dnn);
    return st;
}

void dit_cuda_cudnn_destroy(dit_cuda_backend *cb)
{
    cuda_cudnn *dnn = cb->dnn;
    if (!dnn)
        return;
    if (dnn->loaded)
        for (size_t i = 0; i < dnn->n_plans; i++)
            plan_release(dnn, &dnn->plans[i]);
    cudnn_close(dnn);
    free(dnn->plans);
    free(dnn);
    cb->dnn = NULL;
}

#else /* !DIT_HAVE_CUDNN */

bool dit_cuda_cudnn_eligible(const dit_tensor *, const dit_tensor *, const dit_tensor *,
                             const dit_tensor *, const dit_tensor *)
{
    return false;
}

dit_status dit_cuda_cudnn_attention(dit_cuda_backend *cb, const char *, const dit_tensor *,
                                    const dit_tensor *, const dit_tensor *, const dit_tensor *,
                                    const dit_tensor *, float, bool *ran)
{
    *ran = false;
    cb->stats.attn_cudnn_fallback_calls++;
    return DIT_OK;
}

dit_status dit_cuda_cudnn_open(dit_cuda_backend *, char *why, size_t n)
{
    snprintf(why, n, "this build has no cuDNN headers (cudnn_graph.h)");
    return DIT_ERR_UNSUPPORTED;
}

extern "C" dit_status dit_cudnn_sdpa_check(const dit_tensor *, const dit_tensor *,
                                           const dit_tensor *, const dit_tensor *,
                                           const dit_tensor *, char *why, size_t n)
{
    snprintf(why, n, "this build has no cuDNN headers (cudnn_graph.h)");
    return DIT_ERR_UNSUPPORTED;
}

void dit_cuda_cudnn_destroy(dit_cuda_backend *)
{
}

#endif
