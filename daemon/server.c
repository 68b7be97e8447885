#include "server.h"

#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <dirent.h>
#include <sys/stat.h>

#include "grpc_health_v1_health.pb-c.h"
#include "core/file_id.h"
#include "core/utf8.h"
#include "ipc_wire.h"
#include "results.h"
#include "serve/request.h"
#include "status_map.h"

_Static_assert(DIT_DAEMON_MAX_BATCH <= DIT_IPC_MAX_MEMBERS, "a worker runs every batch ditd makes");

struct job {
    dit_queue_item qi; /* its place in dit_server.queue; qi.priority is the request's */
    dit_server *srv;
    job_kind kind;
    uint64_t id, seq;
    char request_id[140];
    Ditserve__V1__GenerateRequest *req; /* owned */
    dit_rpc_call *call;                 /* NULL once the client is gone */
    dit_job_client client;              /* instead of call (HTTP); .finish NULL when none */
    double arrived_ms, started_ms;
    int last_position;
    int width, height, frames, steps;
    double last_elapsed_ms;  /* at the previous progress event */
    char warning[300];       /* a request field without effect; Result.warnings */
    char cancel_reason[200]; /* why a running job was cancelled, for the request log */
    int told;                /* what its client was told before the job ended; -1: nothing */
    bool was_loaded;         /* UnloadLora: the adapter was loaded when it ran */
    dit_server_mesh *mesh;   /* the mesh running it; NULL while queued */
    int target;              /* the mesh that must run it (startup warm-up), -1: any */
    int batch_size;          /* requests in the generation it ran in */
};

#define JOB_OF(it) DIT_QUEUE_ENTRY(it, job, qi)

/* The images one batch may hold, over its members (each at most
 * DIT_GEN_MAX_IMAGES): what the workers hold at once stays bounded. */
#define DIT_SERVER_MAX_BATCH_IMAGES 16

static double now_ms(void)
{
    return (double)uv_hrtime() / 1e6;
}

static void job_free(job *j)
{
    if (!j)
        return;
    if (j->req)
        ditserve__v1__generate_request__free_unpacked(j->req, NULL);
    free(j);
}

/* ------------------------------------------------------------------------ */
/* Sending                                                                   */

static void send_event(job *j, Ditserve__V1__GenerateEvent *ev)
{
    ev->request_id = j->request_id;
    if (j->call)
        dit_rpc_call_send_message(j->call, &ev->base);
    else if (j->client.event)
        j->client.event(j->client.ctx, ev);
}

/* Whether someone still waits for the job's events. */
static bool has_client(const job *j)
{
    return j->call || j->client.finish;
}

static void send_queued(job *j, int position, int depth)
{
    Ditserve__V1__Queued q = DITSERVE__V1__QUEUED__INIT;
    q.position = position;
    q.queue_depth = depth;
    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_QUEUED;
    ev.queued = &q;
    send_event(j, &ev);
    j->last_position = position;
}

/* ------------------------------------------------------------------------ */
/* Health                                                                    */

static bool known_service(const char *name)
{
    return !name || !*name || strcmp(name, "ditserve.v1.Generation") == 0;
}

static Grpc__Health__V1__HealthCheckResponse__ServingStatus health_of(const dit_server *s)
{
    return s->serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static void send_health(dit_rpc_call *c, Grpc__Health__V1__HealthCheckResponse__ServingStatus st)
{
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = st;
    dit_rpc_call_send_message(c, &r.base);
}

/* A mesh that may take requests: ready and warmed up (--warmup). */
static bool mesh_serving(const dit_server_mesh *m)
{
    return m->sup && dit_supervisor_state(m->sup) == DIT_MESH_READY && m->warmed;
}

static bool any_mesh_serving(const dit_server *s)
{
    for (int i = 0; i < s->n_meshes; i++)
        if (mesh_serving(&s->meshes[i]))
            return true;
    return false;
}

/* A mesh's state as clients read it. */
static const char *mesh_state_text(const dit_server *s, const dit_server_mesh *m)
{
    const dit_mesh_state st = dit_supervisor_state(m->sup);
    if (s->draining)
        return "draining";
    if (st == DIT_MESH_READY && !m->warmed)
        return "warming_up";
    return dit_mesh_state_name(st);
}

static void update_health(dit_server *s)
{
    if (s->meshes_changed) {
        const char *states[DIT_DAEMON_MAX_REPLICAS];
        for (int i = 0; i < s->n_meshes; i++)
            states[i] = mesh_state_text(s, &s->meshes[i]);
        s->meshes_changed(s->health_ctx, s->n_meshes, states);
    }
    const bool serving = any_mesh_serving(s) && !s->draining;
    if (serving == s->serving)
        return;
    s->serving = serving;
    DIT_LOG(s->log, DIT_LOG_INFO, "health", "%s", serving ? "SERVING" : "NOT_SERVING");
    if (s->health_changed)
        s->health_changed(s->health_ctx, serving);
    for (int i = 0; i < s->n_watchers; i++)
        if (dit_rpc_call_user(s->watchers[i]) == NULL) /* known service */
            send_health(s->watchers[i], health_of(s));
}

/* The request's service name, or -1 after answering a request that does
 * not parse. 1: known, 0: unknown (its name copied into name). */
static int health_service(dit_rpc_call *call, const uint8_t *req, size_t len, char *name,
                          size_t cap)
{
    Grpc__Health__V1__HealthCheckRequest *r =
        grpc__health__v1__health_check_request__unpack(NULL, len, req);
    if (!r) {
        dit_rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT,
                            "not a grpc.health.v1.HealthCheckRequest");
        return -1;
    }
    const int known = known_service(r->service);
    snprintf(name, cap, "%s", r->service ? r->service : "");
    grpc__health__v1__health_check_request__free_unpacked(r, NULL);
    return known;
}

static void on_health_check(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    dit_server *s = ctx;
    char service[200];
    const int known = health_service(call, req, len, service, sizeof service);
    if (known < 0)
        return;
    if (!known) {
        char msg[300];
        snprintf(msg, sizeof msg,
                 "unknown service '%s' (this server reports '' and "
                 "'ditserve.v1.Generation')",
                 service);
        dit_rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, msg);
    } else {
        send_health(call, health_of(s));
        dit_rpc_call_finish(call, GRPC_STATUS_OK, NULL);
    }
}

/* Health watches open at once, over every client: each is a call ditd
 * holds and tells of every change. */
#define HEALTH_MAX_WATCHERS 1024

static void on_health_watch(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    dit_server *s = ctx;
    char service[200];
    const int known = health_service(call, req, len, service, sizeof service);
    if (known < 0)
        return;
    if (s->draining && !s->serving) {
        send_health(call, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING);
        dit_rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, "the server is shutting down");
        return;
    }
    if (s->n_watchers >= HEALTH_MAX_WATCHERS) {
        dit_rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED,
                            "too many health watches open (1024); use Check, or fewer watches");
        return;
    }
    if (s->n_watchers == s->cap_watchers) {
        int cap = s->cap_watchers ? s->cap_watchers * 2 : 16;
        dit_rpc_call **nw = realloc(s->watchers, (size_t)cap * sizeof *nw);
        if (!nw) {
            dit_rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        s->watchers = nw;
        s->cap_watchers = cap;
    }
    /* The user pointer marks watchers of unknown services (no updates). */
    dit_rpc_call_set_user(call, known ? NULL : (void *)1);
    s->watchers[s->n_watchers++] = call;
    send_health(call,
                known ? health_of(s)
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN);
}

static void on_health_watch_cancel(void *ctx, dit_rpc_call *call)
{
    dit_server *s = ctx;
    for (int i = 0; i < s->n_watchers; i++)
        if (s->watchers[i] == call) {
            s->watchers[i] = s->watchers[--s->n_watchers];
            break;
        }
    dit_rpc_call_finish(call, GRPC_STATUS_CANCELLED, NULL);
}

/* ------------------------------------------------------------------------ */
/* Queue                                                                     */

static void update_positions(dit_server *s)
{
    const int queued = dit_queue_length(&s->queue);
    dit_metrics_gauges(s->metrics, queued, s->n_running);
    /* With every mesh busy, the running jobs are ahead of every queued one:
     * "0 ahead" must mean "runs at once". Only Generate streams get the
     * update: a Warmup call is unary, and a second message before its
     * WarmupResponse would break it. */
    bool idle = false;
    for (int i = 0; i < s->n_meshes; i++)
        idle |= s->meshes[i].n_members == 0 && mesh_serving(&s->meshes[i]);
    int pos = idle ? 0 : 1;
    for (dit_queue_item *it = dit_queue_peek(&s->queue); it; it = dit_queue_next(it), pos++) {
        job *j = JOB_OF(it);
        if (j->kind == JOB_GENERATE && j->last_position != pos)
            send_queued(j, pos, queued);
    }
}

static void enqueue(dit_server *s, job *j)
{
    dit_queue_push(&s->queue, &j->qi);
    j->last_position = -1;
}

static void fail_job(job *j, grpc_status_code code, const char *msg)
{
    if (has_client(j))
        j->told = (int)code;
    if (j->call) {
        dit_rpc_call_set_user(j->call, NULL);
        dit_rpc_call_finish(j->call, code, msg);
        j->call = NULL;
    } else if (j->client.finish) {
        const dit_job_client c = j->client;
        j->client = (dit_job_client){0};
        c.finish(c.ctx, code, msg);
    }
}

#define LORA_PATH_MAX 4400

/* The file of adapter `name` (checked by dit_request_validate): the
 * preloaded one (--lora NAME=PATH) or DIR/NAME.safetensors under
 * --lora-dir, which must be a regular file now. Anything else is refused,
 * with the reason in why. */
static grpc_status_code lora_path(const dit_server *s, const char *name, char *buf, size_t cap,
                                  char *why, size_t whycap)
{
    const dit_daemon_config *c = s->cfg;
    buf[0] = '\0';
    for (int i = 0; i < c->n_preload_loras; i++)
        if (strcmp(c->preload_loras[i].name, name) == 0) {
            snprintf(buf, cap, "%s", c->preload_loras[i].path);
            return GRPC_STATUS_OK;
        }
    if (!c->lora_dir && c->n_preload_loras == 0) {
        snprintf(why, whycap,
                 "this server has no LoRA adapters (its operator starts ditd with --lora-dir DIR "
                 "or --lora NAME=PATH for that)");
        return GRPC_STATUS_FAILED_PRECONDITION;
    }
    struct stat sb;
    if (c->lora_dir && (size_t)snprintf(buf, cap, "%s/%s.safetensors", c->lora_dir, name) < cap &&
        stat(buf, &sb) == 0 && S_ISREG(sb.st_mode))
        return GRPC_STATUS_OK;
    snprintf(why, whycap, "no LoRA adapter named '%s' (ListLoras lists them)", name);
    return GRPC_STATUS_NOT_FOUND;
}

/* The bytes a rank 0 holds for the adapter of file `path` (the first mesh
 * that has it loaded), or -1 when no mesh has. */
static int64_t lora_loaded_bytes(const dit_server *s, const char *path)
{
    for (int k = 0; k < s->n_meshes; k++) {
        const dit_server_mesh *m = &s->meshes[k];
        for (int i = 0; i < m->n_loras_loaded; i++)
            if (strcmp(m->loras_loaded[i].path, path) == 0)
                return m->loras_loaded[i].bytes;
    }
    return -1;
}

/* The bytes a raw result of request r takes in a worker's message (0 for
 * encoded formats, which are far smaller). */
/* The most bytes a request's results can take in rank 0's JobDone: raw f32
 * RGB exactly; a PNG or MP4 at most about its 8-bit pixels (incompressible
 * noise) and a little framing. A batch's bounds together fit one worker
 * message, so that no batch fails where its members alone would not. */
static int64_t result_bound_bytes(const dit_server *s, const Ditserve__V1__GenerateRequest *r)
{
    const int64_t w = r->width ? r->width : s->info.default_width;
    const int64_t h = r->height ? r->height : s->info.default_height;
    const int64_t f = r->num_frames ? r->num_frames : s->info.default_frames;
    const int64_t n = r->num_images > 1 ? r->num_images : 1;
    const int64_t px = w * h * (f > 1 ? f : 1) * n;
    if (dit_request_output_format(r, &s->info) ==
        DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR)
        return 12 * px;
    return 3 * px + px / 64 + 65536 * n;
}

static int images_of(const Ditserve__V1__GenerateRequest *r)
{
    return r->num_images > 1 ? r->num_images : 1;
}

/* Whether mesh m may run job j: a startup warm-up runs on its own mesh. */
static bool eligible(const job *j, const dit_server_mesh *m)
{
    if (j->target >= 0)
        return j->target == m->index;
    return m->warmed;
}

/* A client's own deadline timer cancels the call as the deadline passes,
 * which ditd hears up to a one-way trip early by its clock. */
#define DEADLINE_SLACK_MS 50.0

/* Ends within slack_ms by its client's deadline (none for HTTP jobs). */
static bool deadline_within(const job *j, double slack_ms)
{
    return j->call && !dit_rpc_call_cancelled(j->call) &&
           dit_rpc_call_deadline_ms(j->call) <= slack_ms;
}

/* Past its deadline while it waited: the call's cancel is on its way (and
 * takes it out of the queue); it is not sent to a mesh meanwhile. */
static bool expired(const job *j)
{
    return deadline_within(j, 0.0);
}

/* When the oldest job mesh m may run arrived (ms; 0 when none). */
static double oldest_arrival(dit_server *s, const dit_server_mesh *m)
{
    double oldest = 0;
    for (dit_queue_item *it = dit_queue_peek(&s->queue); it; it = dit_queue_next(it)) {
        const job *j = JOB_OF(it);
        if (has_client(j) && eligible(j, m) && (oldest == 0 || j->arrived_ms < oldest))
            oldest = j->arrived_ms;
    }
    return oldest;
}

/* The batch mesh m runs next: the first job it may run (the highest
 * priority, then the oldest) and, for a Generate job with --max-batch
 * above 1, the waiting Generate jobs dit_request_batchable pairs with it,
 * in queue order. A job joins only if no job it would overtake has a
 * higher priority than its own, so a batch never delays a more urgent
 * request; equal priorities may be overtaken. The images in a batch are at
 * most DIT_SERVER_MAX_BATCH_IMAGES, and its requests and its results (by
 * result_bound_bytes) each fit one worker message. Jobs whose client left are freed on the
 * way. Returns the count (0: nothing to run); *room says whether another
 * request could still join (for --batch-wait-ms). */
static int collect_batch(dit_server *s, dit_server_mesh *m, job **out, bool *room)
{
    *room = false;
    job *head = NULL;
    dit_queue_item *it = dit_queue_peek(&s->queue);
    while (it) {
        job *j = JOB_OF(it);
        it = dit_queue_next(it);
        if (!has_client(j) && j->kind != JOB_STARTUP_WARMUP) {
            dit_queue_remove(&s->queue, &j->qi);
            job_free(j); /* the client left while it waited */
            continue;
        }
        if (eligible(j, m) && !expired(j)) {
            head = j;
            break;
        }
    }
    if (!head)
        return 0;
    out[0] = head;
    int n = 1;
    if (head->kind != JOB_GENERATE || s->cfg->max_batch <= 1)
        return 1;
    int images = images_of(head->req);
    int64_t bound = result_bound_bytes(s, head->req);
    size_t bytes = ditserve__v1__generate_request__get_packed_size(head->req);
    int skipped_max = INT_MIN;
    for (; it && n < s->cfg->max_batch; it = dit_queue_next(it)) {
        job *j = JOB_OF(it);
        if (!has_client(j) || expired(j))
            continue;
        const size_t jb =
            j->kind == JOB_GENERATE ? ditserve__v1__generate_request__get_packed_size(j->req) : 0;
        const bool fits = j->kind == JOB_GENERATE && j->qi.priority >= skipped_max &&
                          images + images_of(j->req) <= DIT_SERVER_MAX_BATCH_IMAGES &&
                          bound + result_bound_bytes(s, j->req) <= (int64_t)DIT_IPC_MAX_RESULT &&
                          bytes + jb <= DIT_IPC_MAX_REQUESTS &&
                          dit_request_batchable(head->req, j->req, &s->info);
        if (!fits) {
            skipped_max = j->qi.priority > skipped_max ? j->qi.priority : skipped_max;
            continue;
        }
        images += images_of(j->req);
        bound += result_bound_bytes(s, j->req);
        bytes += jb;
        out[n++] = j;
    }
    *room = n < s->cfg->max_batch && images < DIT_SERVER_MAX_BATCH_IMAGES;
    return n;
}

/* The adapters of a job as admitted: the preloaded file of that name, or
 * the one in --lora-dir (a file gone since fails when loaded). */
typedef struct job_loras {
    Ditserve__Ipc__JobLora jl[DIT_REQUEST_MAX_LORAS], *jlp[DIT_REQUEST_MAX_LORAS];
    char paths[DIT_REQUEST_MAX_LORAS][LORA_PATH_MAX];
    size_t n;
} job_loras;

static void resolve_loras(const dit_server *s, const job *j, job_loras *L)
{
    L->n = 0;
    const bool with_loras =
        j->kind == JOB_GENERATE || j->kind == JOB_LORA_LOAD || j->kind == JOB_LORA_UNLOAD;
    for (size_t i = 0; with_loras && i < j->req->n_loras && i < DIT_REQUEST_MAX_LORAS; i++) {
        char why[DIT_DIAG_MAX];
        lora_path(s, j->req->loras[i]->name, L->paths[L->n], sizeof L->paths[L->n], why,
                  sizeof why);
        ditserve__ipc__job_lora__init(&L->jl[L->n]);
        L->jl[L->n].name = j->req->loras[i]->name;
        L->jl[L->n].path = L->paths[L->n];
        L->jl[L->n].scale = j->req->loras[i]->scale;
        /* The file as it is now: every rank loads these bytes or refuses
         * (a file gone since gets the workers' own message). */
        dit_file_id id;
        if (dit_file_id_of(L->paths[L->n], &id)) {
            L->jl[L->n].file_dev = id.dev;
            L->jl[L->n].file_ino = id.ino;
            L->jl[L->n].file_size = id.size;
            L->jl[L->n].file_mtime_ns = id.mtime_ns;
        }
        L->jlp[L->n] = &L->jl[L->n];
        L->n++;
    }
}

/* Sends the batch b[0..n) (already out of the queue) to mesh m; false
 * when it could not be sent (its jobs failed, the mesh still idle). */
static void log_unrun(dit_server *s, const job *j, grpc_status_code code, const char *why);

/* The members' Queued (for one that arrived to an idle mesh and was never
 * told its place: 0, "runs at once", with the queue as it was) and Started
 * events, once the job is on its way to the workers. */
static void tell_started(dit_server *s, dit_server_mesh *m, job **b, int n)
{
    const int depth = dit_queue_length(&s->queue) + n;
    for (int k = 0; k < n; k++) {
        job *j = b[k];
        const double queue_ms = j->started_ms - j->arrived_ms;
        if (j->kind == JOB_GENERATE) {
            if (j->last_position < 0)
                send_queued(j, 0, depth);
            Ditserve__V1__Started st = DITSERVE__V1__STARTED__INIT;
            st.queue_ms = queue_ms;
            Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
            ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_STARTED;
            ev.started = &st;
            send_event(j, &ev);
        }
        DIT_LOG(s->log, DIT_LOG_DEBUG, "queue",
                "job %llu (%s) starts on %s after %.1f ms in the queue%s",
                (unsigned long long)j->id, j->request_id, m->name, queue_ms,
                n > 1 ? (k ? ", batched" : ", heading a batch") : "");
    }
}

/* The job goes to the workers first and its clients hear of it after: a
 * send to a client is a socket write, and the workers need not wait for it. */
static bool run_batch(dit_server *s, dit_server_mesh *m, job **b, int n)
{
    const double now = now_ms();
    for (int k = 0; k < n; k++) {
        job *j = b[k];
        j->mesh = m;
        j->batch_size = n;
        j->started_ms = now;
        m->members[k] = j;
    }
    m->n_members = n;
    m->job_id = b[0]->id;
    m->busy_since_ms = now;
    s->n_running += n;
    job *j = b[0];
    job_loras *L = malloc(sizeof *L);
    Ditserve__Ipc__BatchMember bm[DIT_DAEMON_MAX_BATCH], *bmp[DIT_DAEMON_MAX_BATCH];
    char *evict[1];
    dit_diag diag;
    dit_diag_clear(&diag);
    Ditserve__Ipc__Job ij = DITSERVE__IPC__JOB__INIT;
    if (!L) {
        dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto failed;
    }
    resolve_loras(s, j, L);
    ij.request = j->req;
    ij.warmup = j->kind != JOB_GENERATE;
    ij.lora_only = j->kind == JOB_LORA_LOAD || j->kind == JOB_LORA_UNLOAD;
    if (j->kind == JOB_LORA_UNLOAD) {
        evict[0] = L->n ? L->paths[0] : (char *)"";
        j->was_loaded = L->n && lora_loaded_bytes(s, L->paths[0]) >= 0;
        ij.lora_evict = evict;
        ij.n_lora_evict = 1;
    } else {
        ij.loras = L->jlp;
        ij.n_loras = L->n;
    }
    for (int k = 1; k < n; k++) {
        ditserve__ipc__batch_member__init(&bm[k - 1]);
        bm[k - 1].job_id = b[k]->id;
        bm[k - 1].request = b[k]->req;
        bmp[k - 1] = &bm[k - 1];
    }
    ij.n_batch = (size_t)(n - 1);
    ij.batch = bmp;
    const uint64_t id = j->id;
    const bool generation = j->kind == JOB_GENERATE;
    if (dit_supervisor_run(m->sup, id, &ij, &diag) == DIT_OK) {
        free(L);
        /* A mesh that broke as the job went out ended it already (job_done
         * ran and freed the members, b[0] included): nothing started, to
         * tell or to count. */
        if (m->n_members == n && m->job_id == id) {
            if (generation) /* requests per generation: no warm-ups, no loads */
                dit_metrics_batch(s->metrics, n);
            tell_started(s, m, b, n);
        }
        return true;
    }
failed:
    free(L);
    s->n_running -= n;
    m->n_members = 0;
    m->job_id = 0;
    m->busy_since_ms = 0;
    for (int k = 0; k < n; k++) {
        m->members[k] = NULL;
        if (b[k]->kind == JOB_STARTUP_WARMUP && dit_supervisor_state(m->sup) == DIT_MESH_READY) {
            /* Its message could not be made while the mesh stands: it would
             * fail again, and nothing would queue another (only a rebuilt
             * mesh does). Serve without it and say so, as for a warm-up
             * that failed on the workers (member_done). */
            m->warmed = true;
            s->warmed = true;
            DIT_LOG(s->log, DIT_LOG_WARN, "warmup", "warm-up%s%s not run: %s",
                    s->n_meshes > 1 ? " of " : "", s->n_meshes > 1 ? m->name : "",
                    dit_diag_msg(&diag));
        }
        log_unrun(s, b[k], dit_status_to_grpc(diag.status), dit_diag_msg(&diag));
        fail_job(b[k], dit_status_to_grpc(diag.status), dit_diag_msg(&diag));
        job_free(b[k]);
    }
    update_health(s); /* a mesh served without its warm-up is SERVING */
    return false;
}

static void try_dispatch(dit_server *s);

static void on_batch_timer(uv_timer_t *t)
{
    try_dispatch(t->data);
}

static void try_dispatch(dit_server *s)
{
    job *b[DIT_DAEMON_MAX_BATCH];
    bool tried[DIT_DAEMON_MAX_REPLICAS] = {false};
    double wait_min = 0; /* the shortest wait of a batch held open, ms */
    /* Each idle mesh once: one may find nothing it may run (a warm-up
     * waits for another) while the next has work. */
    for (int i = 0; i < s->n_meshes; i++) {
        dit_server_mesh *m = &s->meshes[i];
        if (tried[i] || m->n_members != 0 || !m->sup || !dit_supervisor_idle(m->sup))
            continue;
        tried[i] = true;
        bool room = false;
        const int n = collect_batch(s, m, b, &room);
        if (n == 0)
            continue;
        if (room && b[0]->kind == JOB_GENERATE && s->cfg->batch_wait_ms > 0) {
            /* --batch-wait-ms: the mesh may wait for company until the
             * oldest job it could run has waited that long (a more urgent
             * head that came later does not restart the clock), and never
             * past a member's deadline. The timer looks again when the
             * first wait is over. The other meshes still run what they may
             * (a startup warm-up of their own). */
            const double wait = oldest_arrival(s, m) + s->cfg->batch_wait_ms - now_ms();
            bool due = false;
            for (int k = 0; k < n; k++)
                due = due || deadline_within(b[k], wait + DEADLINE_SLACK_MS);
            if (wait > 0.5 && !due) {
                wait_min = wait_min > 0 && wait_min < wait ? wait_min : wait;
                continue;
            }
        }
        for (int k = 0; k < n; k++)
            dit_queue_remove(&s->queue, &b[k]->qi);
        if (!run_batch(s, m, b, n))
            tried[i] = false; /* still idle: it may take what queued behind */
        i = -1;               /* the queue changed: every idle mesh may look again */
    }
    if (wait_min > 0 && s->batch_timer_up)
        uv_timer_start(&s->batch_timer, on_batch_timer, (uint64_t)wait_min + 1, 0);
    update_positions(s);
}

/* ------------------------------------------------------------------------ */
/* Generate and Warmup                                                       */

static uint64_t random_seed(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
        v = (uint64_t)uv_hrtime() * 0x9e3779b97f4a7c15ull;
    return v & 0x7fffffffffffffffull;
}

/* Why a request was refused: a gRPC code and a message for the client. */
typedef struct reply {
    grpc_status_code code;
    char msg[DIT_DIAG_MAX];
} reply;

static bool refuse(reply *rp, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static bool refuse(reply *rp, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp->code = code;
    vsnprintf(rp->msg, sizeof rp->msg, fmt, ap);
    va_end(ap);
    return false;
}

/* Finished results wait in ditd until their client reads them. A client
 * that stops reading must not make ditd hold result after result, so past
 * --max-unread-bytes on its connection (or --max-unread-total in all) new
 * calls are refused. `call` NULL (an HTTP request): the total only. */
static bool unread_ok(dit_server *s, dit_rpc_call *call, reply *rp)
{
    const int64_t conn = call ? dit_rpc_call_conn_unsent(call) : 0,
                  all = dit_rpc_server_unsent(s->rpc) +
                        (s->front_held ? s->front_held(s->health_ctx) : 0);
    if (conn >= s->cfg->max_unread_bytes)
        return refuse(rp, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "this connection has %lld bytes of results it has not read (the limit is "
                      "%lld, --max-unread-bytes); read them before sending more requests",
                      (long long)conn, (long long)s->cfg->max_unread_bytes);
    if (all >= s->cfg->max_unread_total)
        return refuse(rp, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "clients have %lld bytes of results they have not read (the limit is %lld, "
                      "--max-unread-total); retry later",
                      (long long)all, (long long)s->cfg->max_unread_total);
    return true;
}

/* Common admission of `n` jobs: draining, mesh state, queue room, unread
 * results. */
static bool admit(dit_server *s, dit_rpc_call *call, int n, reply *rp)
{
    if (s->draining)
        return refuse(rp, GRPC_STATUS_UNAVAILABLE,
                      "the server is shutting down; send the request to another replica");
    bool ready = false;
    for (int i = 0; i < s->n_meshes; i++)
        ready |= dit_supervisor_state(s->meshes[i].sup) == DIT_MESH_READY;
    if (!ready)
        return refuse(rp, GRPC_STATUS_UNAVAILABLE,
                      "the workers are not ready (mesh %s); retry shortly",
                      dit_mesh_state_name(dit_supervisor_state(s->meshes[0].sup)));
    if (dit_queue_length(&s->queue) + n > s->cfg->max_queue) {
        if (n > 1)
            return refuse(rp, GRPC_STATUS_RESOURCE_EXHAUSTED,
                          "the queue has room for %d of the %d requested images (%d requests "
                          "waiting); retry later",
                          s->cfg->max_queue - dit_queue_length(&s->queue), n,
                          dit_queue_length(&s->queue));
        return refuse(rp, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "the queue is full (%d requests waiting); retry later",
                      dit_queue_length(&s->queue));
    }
    return unread_ok(s, call, rp);
}

static bool model_ok(dit_server *s, const char *model, reply *rp)
{
    if (!model || !*model || strcmp(model, s->cfg->model_name) == 0)
        return true;
    /* Echoed below: whole UTF-8 characters only. */
    const size_t n = strlen(model);
    if (n > 256)
        return refuse(rp, GRPC_STATUS_INVALID_ARGUMENT, "model is %zu bytes; at most 256", n);
    if (!dit_utf8_valid(model, n))
        return refuse(rp, GRPC_STATUS_INVALID_ARGUMENT, "model is not valid UTF-8");
    return refuse(rp, GRPC_STATUS_NOT_FOUND,
                  "model '%.256s' is not served here (available: '%.256s')", model,
                  s->cfg->model_name);
}

/* The server's own limit on image size, beyond what the model allows. */
bool dit_server_size_ok(const dit_daemon_config *cfg, const dit_pipeline_info *info,
                        const Ditserve__V1__GenerateRequest *r, char *msg, size_t cap)
{
    const int64_t w = r->width ? r->width : info->default_width;
    const int64_t h = r->height ? r->height : info->default_height;
    const int64_t f = r->num_frames ? r->num_frames : info->default_frames;
    if (w * h > cfg->max_pixels) {
        snprintf(msg, cap,
                 "%lldx%lld is %lld pixels; this server accepts at most %lld (its "
                 "--max-pixels)",
                 (long long)w, (long long)h, (long long)(w * h), (long long)cfg->max_pixels);
        return false;
    }
    /* Sides and frames are validated (each bounded) before this. */
    if (f > 1 && w * h * f > cfg->max_video_pixels) {
        snprintf(msg, cap,
                 "%lld frames of %lldx%lld are %lld pixels; this server accepts at most %lld "
                 "per video (its --max-video-pixels)",
                 (long long)f, (long long)w, (long long)h, (long long)(w * h * f),
                 (long long)cfg->max_video_pixels);
        return false;
    }
    /* A raw result travels from the worker in one message, every image. */
    const int64_t n = r->num_images > 1 ? r->num_images : 1;
    const int64_t raw = 12 * w * h * f * n;
    if (dit_request_output_format(r, info) ==
            DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR &&
        raw > (int64_t)DIT_IPC_MAX_RESULT) {
        snprintf(msg, cap,
                 "the raw tensor of this request would be %lld bytes; raw results are at "
                 "most %lld: ask for fewer frames or pixels, or for MP4",
                 (long long)raw, (long long)DIT_IPC_MAX_RESULT);
        return false;
    }
    return true;
}

static bool size_ok(dit_server *s, const Ditserve__V1__GenerateRequest *r, reply *rp)
{
    if (dit_server_size_ok(s->cfg, &s->info, r, rp->msg, sizeof rp->msg))
        return true;
    rp->code = GRPC_STATUS_INVALID_ARGUMENT;
    return false;
}

/* The mesh's split rules. The client hears what it can change (the nearest
 * size that splits evenly); the operator's remedy (an "anything" mode) goes
 * to the log, since only the operator can act on it. */
static bool mesh_ok(dit_server *s, const Ditserve__V1__GenerateRequest *r, reply *rp)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_request_validate_mesh(r, &s->info, &s->cfg->pc, &diag) == DIT_OK)
        return true;
    char advice[600];
    dit_request_mesh_advice(r, &s->info, &s->cfg->pc, advice, sizeof advice);
    DIT_LOG(s->log, DIT_LOG_INFO, "request", "request %s refused by the mesh's split rules: %s",
            r->request_id && *r->request_id ? r->request_id : "-", dit_diag_msg(&diag));
    return refuse(rp, GRPC_STATUS_INVALID_ARGUMENT, "%s", advice);
}

/* Every check a Generate request passes before it may wait in the queue,
 * whichever front end it came through. */
static bool generate_ok(dit_server *s, dit_rpc_call *call, const Ditserve__V1__GenerateRequest *r,
                        int n, reply *rp)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (!model_ok(s, r->model, rp))
        return false;
    if (dit_model_info_check_frames(&s->model, r->num_frames, r->fps, &diag) != DIT_OK ||
        dit_request_validate(r, &s->info, &diag) != DIT_OK)
        return refuse(rp, GRPC_STATUS_INVALID_ARGUMENT, "%s", dit_diag_msg(&diag));
    for (size_t i = 0; i < r->n_loras; i++) {
        char path[LORA_PATH_MAX], why[DIT_DIAG_MAX];
        const grpc_status_code code =
            lora_path(s, r->loras[i]->name, path, sizeof path, why, sizeof why);
        if (code != GRPC_STATUS_OK)
            return refuse(rp, code, "loras[%zu]: %s", i, why);
    }
    return mesh_ok(s, r, rp) && size_ok(s, r, rp) && admit(s, call, n, rp);
}

static job *new_job(dit_server *s, job_kind kind, Ditserve__V1__GenerateRequest *r,
                    dit_rpc_call *call)
{
    job *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->srv = s;
    j->kind = kind;
    j->id = ++s->next_job_id;
    j->seq = ++s->next_seq;
    j->req = r;
    j->call = call;
    j->arrived_ms = now_ms();
    j->target = -1;
    j->told = -1;
    j->qi.priority = kind == JOB_GENERATE ? r->priority : INT_MAX;
    if (r->request_id && *r->request_id)
        snprintf(j->request_id, sizeof j->request_id, "%s", r->request_id);
    else
        snprintf(j->request_id, sizeof j->request_id, "req-%llu", (unsigned long long)j->id);
    j->width = r->width ? r->width : s->info.default_width;
    j->height = r->height ? r->height : s->info.default_height;
    j->steps = r->num_inference_steps ? r->num_inference_steps : s->info.default_steps;
    j->frames = r->num_frames ? r->num_frames : s->info.default_frames;
    if (call)
        dit_rpc_call_set_user(call, j);
    return j;
}

/* A seed for a request that gave none, so the image can be reproduced.
 * False when out of memory. */
static bool ensure_seed(Ditserve__V1__GenerateRequest *r)
{
    if (r->seed)
        return true;
    Google__Protobuf__UInt64Value *seed = malloc(sizeof *seed);
    if (!seed)
        return false;
    google__protobuf__uint64_value__init(seed);
    seed->value = random_seed();
    r->seed = seed;
    return true;
}

/* The request's adapters for the request log: "name:scale,..." (the log
 * escapes and caps it; names may still be unchecked here). */
static const char *loras_text(const Ditserve__V1__GenerateRequest *r, char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; r && i < r->n_loras && i < DIT_REQUEST_MAX_LORAS && n < cap; i++) {
        int w = snprintf(buf + n, cap - n, "%s%.128s:%g", i ? "," : "",
                         r->loras[i]->name ? r->loras[i]->name : "", (double)r->loras[i]->scale);
        if (w < 0)
            break;
        n += (size_t)w;
    }
    return buf;
}

/* The request-log line and metric of a Generate job that ends without
 * running (left the queue, the drain's end, a batch that could not be
 * sent); other kinds are not requests. */
static void log_unrun(dit_server *s, const job *j, grpc_status_code code, const char *why)
{
    if (j->kind != JOB_GENERATE)
        return;
    char lor[1200];
    const double waited = now_ms() - j->arrived_ms;
    s->requests_failed++;
    dit_log_request(s->log, j->request_id, s->cfg->model_name, j->width, j->height, j->steps,
                    loras_text(j->req, lor, sizeof lor), waited, 0, dit_rpc_status_name(code), why);
    dit_metrics_request(s->metrics, dit_rpc_status_name(code), waited / 1e3, -1);
}

/* The request-log line and metric of a refused request. */
static void log_refused(dit_server *s, const Ditserve__V1__GenerateRequest *r,
                        grpc_status_code code, const char *why)
{
    char lor[1200];
    s->requests_failed++;
    dit_log_request(s->log, r->request_id && *r->request_id ? r->request_id : "-",
                    r->model && *r->model ? r->model : s->cfg->model_name,
                    r->width ? r->width : DIT_REQUEST_DEFAULT_SIZE,
                    r->height ? r->height : DIT_REQUEST_DEFAULT_SIZE,
                    r->num_inference_steps ? r->num_inference_steps : DIT_REQUEST_DEFAULT_STEPS,
                    loras_text(r, lor, sizeof lor), 0, 0, dit_rpc_status_name(code), why);
    dit_metrics_request(s->metrics, dit_rpc_status_name(code), -1, -1);
}

/* A Generate refused before its request could be read: counted and logged
 * like the others, with what is known (nothing of the request). */
static void log_unread(dit_server *s, grpc_status_code code, const char *why)
{
    s->requests_failed++;
    dit_log_request(s->log, "-", s->cfg->model_name, 0, 0, 0, "", 0, 0, dit_rpc_status_name(code),
                    why);
    dit_metrics_request(s->metrics, dit_rpc_status_name(code), -1, -1);
}

void dit_server_rpc_refused(void *ctx, const char *path, grpc_status_code code, const char *why)
{
    if (strcmp(path, "/ditserve.v1.Generation/Generate") == 0)
        log_unread(ctx, code, why);
}

static void on_generate(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    dit_server *s = ctx;
    Ditserve__V1__GenerateRequest *r = ditserve__v1__generate_request__unpack(NULL, len, req);
    if (!r) {
        const char *why = "the request is not a valid ditserve.v1.GenerateRequest message";
        /* Counted and logged before the client hears (it may look). */
        log_unread(s, GRPC_STATUS_INVALID_ARGUMENT, why);
        dit_rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, why);
        return;
    }
    dit_request_strip_unknown(&r->base);
    reply rp = {GRPC_STATUS_OK, ""};
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_request_check_strings(&ditserve__v1__generate_request__descriptor, req, len, &diag) !=
        DIT_OK) {
        refuse(&rp, GRPC_STATUS_INVALID_ARGUMENT, "%s", dit_diag_msg(&diag));
        goto reject;
    }
    if (!generate_ok(s, call, r, 1, &rp))
        goto reject;
    job *j = ensure_seed(r) ? new_job(s, JOB_GENERATE, r, call) : NULL;
    if (!j) {
        refuse(&rp, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        goto reject;
    }
    dit_request_warning(r, &s->info, j->warning, sizeof j->warning);
    enqueue(s, j);
    /* try_dispatch tells the queue its places, after sending what runs. */
    try_dispatch(s);
    return;
reject:
    /* Refused requests get their request-log line too, before the client
     * hears (it may look). */
    log_refused(s, r, rp.code, rp.msg);
    dit_rpc_call_finish(call, rp.code, rp.msg);
    ditserve__v1__generate_request__free_unpacked(r, NULL);
}

/* Takes a job away from its client: a queued one leaves the queue and is
 * freed, a running one stops at its next step. */
static void cancel_job(dit_server *s, job *j, grpc_status_code code, const char *reason)
{
    if (j->mesh) {
        /* A batch member leaves at the next step; the others go on. */
        DIT_LOG(s->log, DIT_LOG_INFO, "queue", "request %s cancelled while running", j->request_id);
        snprintf(j->cancel_reason, sizeof j->cancel_reason, "%s", reason);
        dit_supervisor_cancel(j->mesh->sup, j->id);
    } else {
        DIT_LOG(s->log, DIT_LOG_INFO, "queue", "request %s cancelled while queued", j->request_id);
        log_unrun(s, j, code, "left the queue");
        dit_queue_remove(&s->queue, &j->qi);
        job_free(j);
        try_dispatch(s); /* what a held batch waited for may have changed */
    }
}

static void on_job_cancel(void *ctx, dit_rpc_call *call)
{
    dit_server *s = ctx;
    job *j = dit_rpc_call_user(call);
    /* Ended by its deadline or by the client: the log and metrics say which.
     * A client's own deadline timer cancels the call as the deadline
     * passes, which ditd hears up to a one-way trip early by its clock. */
    const bool late = dit_rpc_call_deadline_ms(call) <= DEADLINE_SLACK_MS;
    const grpc_status_code code = late ? GRPC_STATUS_DEADLINE_EXCEEDED : GRPC_STATUS_CANCELLED;
    dit_rpc_call_finish(call, code, late ? "deadline exceeded" : "cancelled");
    if (!j)
        return;
    j->call = NULL;
    j->told = code;
    cancel_job(s, j, code, late ? "the call's deadline passed" : "the client cancelled the call");
}

dit_status dit_server_submit(dit_server *s, Ditserve__V1__GenerateRequest **reqs, int n,
                             const dit_job_client *clients, dit_server_job **jobs,
                             grpc_status_code *code, char *msg, size_t cap)
{
    reply rp = {GRPC_STATUS_OK, ""};
    job *made[DIT_SERVER_MAX_SUBMIT] = {0};
    int k;
    if (n < 1 || n > DIT_SERVER_MAX_SUBMIT) {
        refuse(&rp, GRPC_STATUS_INVALID_ARGUMENT, "n must be 1 to %d", DIT_SERVER_MAX_SUBMIT);
        goto reject;
    }
    for (k = 0; k < n; k++)
        if (!generate_ok(s, NULL, reqs[k], n, &rp))
            goto reject;
    for (k = 0; k < n; k++)
        if (!ensure_seed(reqs[k]) || !(made[k] = new_job(s, JOB_GENERATE, reqs[k], NULL))) {
            refuse(&rp, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            goto reject;
        }
    for (k = 0; k < n; k++) {
        made[k]->client = clients[k];
        dit_request_warning(reqs[k], &s->info, made[k]->warning, sizeof made[k]->warning);
        enqueue(s, made[k]);
        jobs[k] = made[k];
    }
    try_dispatch(s);
    return DIT_OK;
reject:
    for (k = 0; k < n && k < DIT_SERVER_MAX_SUBMIT; k++)
        if (made[k]) {
            made[k]->req = NULL; /* still the caller's */
            job_free(made[k]);
        }
    log_refused(s, reqs[0], rp.code, rp.msg);
    *code = rp.code;
    snprintf(msg, cap, "%s", rp.msg);
    return DIT_ERR_INVALID_ARG;
}

void dit_server_cancel(dit_server *s, dit_server_job *j, const char *reason)
{
    if (!j)
        return;
    j->client = (dit_job_client){0};
    j->told = GRPC_STATUS_CANCELLED; /* the front end tells its client */
    cancel_job(s, j, GRPC_STATUS_CANCELLED, reason);
}

static void on_warmup(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    dit_server *s = ctx;
    Ditserve__V1__WarmupRequest *w = ditserve__v1__warmup_request__unpack(NULL, len, req);
    if (!w) {
        dit_rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "not a WarmupRequest");
        return;
    }
    Ditserve__V1__GenerateRequest *r = NULL;
    reply rp = {GRPC_STATUS_OK, ""};
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_request_check_strings(&ditserve__v1__warmup_request__descriptor, req, len, &diag) !=
        DIT_OK) {
        refuse(&rp, GRPC_STATUS_INVALID_ARGUMENT, "%s", dit_diag_msg(&diag));
        goto done;
    }
    if (!model_ok(s, w->model, &rp))
        goto done;
    r = malloc(sizeof *r);
    char *prompt = strdup("warm-up");
    Google__Protobuf__UInt64Value *seed = malloc(sizeof *seed);
    if (!r || !prompt || !seed) {
        free(r);
        free(prompt);
        free(seed);
        r = NULL;
        refuse(&rp, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        goto done;
    }
    ditserve__v1__generate_request__init(r);
    google__protobuf__uint64_value__init(seed);
    r->prompt = prompt;
    r->seed = seed;
    r->width = w->width;
    r->height = w->height;
    r->num_frames = w->num_frames;
    r->num_inference_steps = w->num_inference_steps ? w->num_inference_steps : 1;
    if (dit_model_info_check_frames(&s->model, r->num_frames, 0, &diag) != DIT_OK ||
        dit_request_validate(r, &s->info, &diag) != DIT_OK) {
        refuse(&rp, GRPC_STATUS_INVALID_ARGUMENT, "%s", dit_diag_msg(&diag));
        goto done;
    }
    if (!mesh_ok(s, r, &rp) || !size_ok(s, r, &rp) || !admit(s, call, 1, &rp))
        goto done;
    job *j = new_job(s, JOB_WARMUP, r, call);
    if (!j) {
        refuse(&rp, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        goto done;
    }
    r = NULL;
    enqueue(s, j);
    try_dispatch(s);
done:
    if (rp.code != GRPC_STATUS_OK)
        dit_rpc_call_finish(call, rp.code, rp.msg);
    if (r)
        ditserve__v1__generate_request__free_unpacked(r, NULL);
    ditserve__v1__warmup_request__free_unpacked(w, NULL);
}

/* --warmup: one generation of that shape on each mesh before it serves
 * (health turns SERVING with the first). */
static void queue_startup_warmup(dit_server *s, dit_server_mesh *m)
{
    if (!s->cfg->warmup || m->warmed)
        return;
    if (s->draining) { /* see dit_server_drain */
        m->warmed = true;
        return;
    }
    for (dit_queue_item *it = dit_queue_peek(&s->queue); it; it = dit_queue_next(it))
        if (JOB_OF(it)->kind == JOB_STARTUP_WARMUP && JOB_OF(it)->target == m->index)
            return;
    if (m->n_members && m->members[0] && m->members[0]->kind == JOB_STARTUP_WARMUP)
        return;
    int w = 0, h = 0, frames = 0, steps = 0;
    dit_warmup_spec_parse(s->cfg->warmup, &w, &h, &frames, &steps);
    Ditserve__V1__GenerateRequest *r = malloc(sizeof *r);
    char *prompt = strdup("warm-up");
    Google__Protobuf__UInt64Value *seed = malloc(sizeof *seed);
    if (!r || !prompt || !seed) {
        free(r);
        free(prompt);
        free(seed);
        return;
    }
    ditserve__v1__generate_request__init(r);
    google__protobuf__uint64_value__init(seed);
    r->prompt = prompt;
    r->seed = seed;
    r->width = w;
    r->height = h;
    r->num_frames = frames;
    r->num_inference_steps = steps;
    job *j = new_job(s, JOB_STARTUP_WARMUP, r, NULL);
    if (!j) {
        ditserve__v1__generate_request__free_unpacked(r, NULL);
        return;
    }
    j->target = m->index;
    if (s->n_meshes > 1)
        snprintf(j->request_id, sizeof j->request_id, "startup-warmup-%s", m->name);
    else
        snprintf(j->request_id, sizeof j->request_id, "startup-warmup");
    enqueue(s, j);
}

/* ------------------------------------------------------------------------ */
/* Mesh events                                                               */

static void on_state(void *ctx, dit_mesh_state st)
{
    dit_server_mesh *m = ctx;
    dit_server *s = m->srv;
    dit_metrics_mesh(s->metrics, m->index, dit_mesh_state_name(st),
                     dit_supervisor_restarts(m->sup));
    /* A rebuilt mesh is new processes: --warmup runs on it again before it
     * takes requests. */
    if (st == DIT_MESH_STARTING || st == DIT_MESH_RESTARTING)
        m->warmed = s->cfg->warmup == NULL || s->draining; /* a drain runs what is queued */
    if (st == DIT_MESH_READY) {
        queue_startup_warmup(s, m);
        try_dispatch(s);
    }
    update_health(s);
}

static void on_progress(void *ctx, uint64_t job_id, int step, int total, double elapsed_ms,
                        const char *stage)
{
    dit_server_mesh *m = ctx;
    dit_server *s = m->srv;
    if (m->n_members == 0 || m->job_id != job_id)
        return;
    /* One step of the batch is one step of each member. */
    bool stepped = false;
    for (int k = 0; k < m->n_members; k++) {
        job *j = m->members[k];
        if (!j || j->kind != JOB_GENERATE || !has_client(j))
            continue;
        if (strcmp(stage, "denoising") == 0) { /* the other stages are not steps */
            if (!stepped)
                dit_metrics_step(s->metrics, (elapsed_ms - j->last_elapsed_ms) / 1e3);
            stepped = true;
            j->last_elapsed_ms = elapsed_ms;
        }
        Ditserve__V1__Progress p = DITSERVE__V1__PROGRESS__INIT;
        p.step = step;
        p.total_steps = total;
        p.elapsed_ms = elapsed_ms;
        p.stage = (char *)stage;
        Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
        ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_PROGRESS;
        ev.progress = &p;
        send_event(j, &ev);
    }
}

/* The workers' JobDone while gRPC still sends result bytes straight out of
 * it: one reference for on_done and one per chunk in flight; the last
 * release frees it, on whichever thread gRPC drops its chunk. */
typedef struct held_result {
    atomic_int refs;
    Ditserve__Ipc__Envelope *env;
} held_result;

static held_result *held_new(Ditserve__Ipc__Envelope *env)
{
    held_result *h = malloc(sizeof *h);
    if (h) {
        atomic_init(&h->refs, 1);
        h->env = env;
    }
    return h;
}

static void held_release(void *p)
{
    held_result *h = p;
    if (atomic_fetch_sub(&h->refs, 1) == 1) {
        ditserve__ipc__envelope__free_unpacked(h->env, NULL);
        free(h);
    }
}

/* One chunk event: to a gRPC client the head packed and the bytes from
 * where the JobDone holds them (held: NULL packs a copy); to a front end,
 * the event. */
static void send_chunk(job *j, held_result *held, int64_t offset, int32_t index,
                       const uint8_t *data, size_t len)
{
    if (j->call && held && len > 0) {
        uint8_t head[256];
        if (dit_chunk_event_head_max(j->request_id) <= sizeof head) {
            const size_t h = dit_chunk_event_head(j->request_id, offset, index, len, head);
            atomic_fetch_add(&held->refs, 1);
            dit_rpc_call_send_parts(j->call, head, h, data, len, held_release, held);
            return;
        }
    }
    Ditserve__V1__ResultChunk rc = DITSERVE__V1__RESULT_CHUNK__INIT;
    rc.offset = offset;
    rc.image_index = index;
    rc.data.data = (uint8_t *)data;
    rc.data.len = len;
    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK;
    ev.chunk = &rc;
    send_event(j, &ev);
}

static void send_result(dit_server *s, job *j, const Ditserve__Ipc__JobDone *d, held_result *held)
{
    const size_t chunk = (size_t)s->cfg->chunk_bytes;
    /* Each image's chunks in turn, offsets within the image. A worker that
     * gives no sizes sent one image. */
    int64_t one = (int64_t)d->image.len;
    const int64_t *sizes = d->n_image_bytes ? d->image_bytes : &one;
    const size_t n_images = d->n_image_bytes ? d->n_image_bytes : 1;
    size_t base = 0;
    for (size_t m = 0; m < n_images; m++) {
        /* Sizes from a worker of another build (a joined one) are checked
         * without overflow: negative or past the image, the rest goes. */
        if (sizes[m] < 0 || (uint64_t)sizes[m] > d->image.len - base)
            break;
        const size_t len = (size_t)sizes[m];
        for (size_t off = 0; off < len; off += chunk)
            send_chunk(j, held, (int64_t)off, (int32_t)m, d->image.data + base + off,
                       len - off < chunk ? len - off : chunk);
        base += len;
    }
    Ditserve__V1__Result res = DITSERVE__V1__RESULT__INIT;
    Ditserve__V1__Timings tm = DITSERVE__V1__TIMINGS__INIT;
    if (d->timings)
        tm = *d->timings;
    tm.base = (ProtobufCMessage)PROTOBUF_C_MESSAGE_INIT(&ditserve__v1__timings__descriptor);
    tm.queue_ms = j->started_ms - j->arrived_ms;
    tm.total_ms = now_ms() - j->arrived_ms;
    res.format = (Ditserve__V1__OutputFormat)dit_request_output_format(j->req, &s->info);
    const bool raw = res.format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR;
    res.seed = d->seed;
    res.width = d->width;
    res.height = d->height;
    res.num_frames = d->num_frames > 0 ? d->num_frames : 1;
    res.fps = d->fps;
    res.total_bytes = (int64_t)d->image.len;
    res.n_image_bytes = n_images;
    res.image_bytes = (int64_t *)sizes;
    res.prompt_truncated = d->prompt_truncated;
    res.timings = &tm;
    res.batch_size = j->batch_size > 0 ? j->batch_size : 1;
    char *warnings[1] = {j->warning};
    if (j->warning[0]) {
        res.n_warnings = 1;
        res.warnings = warnings;
    }
    if (raw) {
        res.dtype = DITSERVE__V1__DTYPE__DTYPE_F32;
        res.n_shape = d->n_shape;
        res.shape = d->shape;
    }
    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_RESULT;
    ev.result = &res;
    send_event(j, &ev);
}

/* ------------------------------------------------------------------------ */
/* LoRA adapters                                                             */

static bool lora_preloaded(const dit_server *s, const char *name)
{
    for (int i = 0; i < s->cfg->n_preload_loras; i++)
        if (strcmp(s->cfg->preload_loras[i].name, name) == 0)
            return true;
    return false;
}

static void lora_info_of(const dit_server *s, const char *name, Ditserve__V1__LoraInfo *li)
{
    char path[LORA_PATH_MAX], why[DIT_DIAG_MAX];
    ditserve__v1__lora_info__init(li);
    li->name = (char *)name;
    li->preloaded = lora_preloaded(s, name);
    if (lora_path(s, name, path, sizeof path, why, sizeof why) == GRPC_STATUS_OK) {
        const int64_t b = lora_loaded_bytes(s, path);
        li->loaded = b >= 0;
        li->bytes = b > 0 ? b : 0;
    }
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* ListLoras: the preloaded adapters, then the --lora-dir files whose names
 * requests may use (at most DIT_SERVER_MAX_LISTED_LORAS), by name. */
#define DIT_SERVER_MAX_LISTED_LORAS 4096
static void on_list_loras(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)req;
    (void)len;
    dit_server *s = ctx;
    const dit_daemon_config *c = s->cfg;
    char **names = calloc(DIT_SERVER_MAX_LISTED_LORAS, sizeof *names);
    Ditserve__V1__LoraInfo *infos = NULL, **ptrs = NULL;
    size_t n = 0;
    if (!names)
        goto oom;
    for (int i = 0; i < c->n_preload_loras; i++)
        if (!(names[n++] = strdup(c->preload_loras[i].name)))
            goto oom;
    DIR *d = c->lora_dir ? opendir(c->lora_dir) : NULL;
    for (struct dirent *e; d && (e = readdir(d)) != NULL && n < DIT_SERVER_MAX_LISTED_LORAS;) {
        const size_t el = strlen(e->d_name), sl = strlen(".safetensors");
        if (el <= sl || strcmp(e->d_name + el - sl, ".safetensors") != 0)
            continue;
        char name[DIT_REQUEST_MAX_LORA_NAME_BYTES + 1];
        if (el - sl > DIT_REQUEST_MAX_LORA_NAME_BYTES)
            continue;
        memcpy(name, e->d_name, el - sl);
        name[el - sl] = '\0';
        char path[LORA_PATH_MAX], why[DIT_DIAG_MAX];
        if (!dit_request_lora_name_ok(name) || lora_preloaded(s, name) ||
            lora_path(s, name, path, sizeof path, why, sizeof why) != GRPC_STATUS_OK)
            continue;
        if (!(names[n++] = strdup(name))) {
            closedir(d);
            goto oom;
        }
    }
    if (d)
        closedir(d);
    qsort(names, n, sizeof *names, cmp_names);
    infos = calloc(n ? n : 1, sizeof *infos);
    ptrs = calloc(n ? n : 1, sizeof *ptrs);
    if (!infos || !ptrs)
        goto oom;
    for (size_t i = 0; i < n; i++) {
        lora_info_of(s, names[i], &infos[i]);
        ptrs[i] = &infos[i];
    }
    Ditserve__V1__ListLorasResponse r = DITSERVE__V1__LIST_LORAS_RESPONSE__INIT;
    r.loras = ptrs;
    r.n_loras = n;
    r.cache_limit_bytes = c->lora_cache_bytes;
    dit_rpc_call_send_message(call, &r.base);
    dit_rpc_call_finish(call, GRPC_STATUS_OK, NULL);
    goto out;
oom:
    dit_rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
out:
    for (size_t i = 0; names && i < n; i++)
        free(names[i]);
    free(names);
    free(infos);
    free(ptrs);
}

/* LoadLora and UnloadLora: a job on every worker, queued like the rest. */
static void lora_op(dit_server *s, dit_rpc_call *call, const uint8_t *req, size_t len,
                    job_kind kind)
{
    reply rp = {GRPC_STATUS_OK, ""};
    Ditserve__V1__GenerateRequest *r = NULL;
    /* Both requests are one string field, name = 1. */
    Ditserve__V1__LoadLoraRequest *lr = ditserve__v1__load_lora_request__unpack(NULL, len, req);
    dit_diag diag;
    dit_diag_clear(&diag);
    if (!lr || dit_request_check_strings(&ditserve__v1__load_lora_request__descriptor, req, len,
                                         &diag) != DIT_OK) {
        refuse(&rp, GRPC_STATUS_INVALID_ARGUMENT, "the request is not a valid %s",
               kind == JOB_LORA_LOAD ? "LoadLoraRequest" : "UnloadLoraRequest");
        goto done;
    }
    if (!dit_request_lora_name_ok(lr->name)) {
        refuse(&rp, GRPC_STATUS_INVALID_ARGUMENT,
               "name must be 1 to %d bytes of [A-Za-z0-9._-] without \"..\"",
               DIT_REQUEST_MAX_LORA_NAME_BYTES);
        goto done;
    }
    if (s->n_meshes > 1) {
        /* Each mesh keeps its own cache; requests naming an adapter load it
         * on the mesh that runs them. */
        refuse(&rp, GRPC_STATUS_FAILED_PRECONDITION,
               "%s is not available with several meshes (ditd --replicas %d): adapters load on "
               "each mesh when a request names them",
               kind == JOB_LORA_LOAD ? "LoadLora" : "UnloadLora", s->n_meshes);
        goto done;
    }
    char path[LORA_PATH_MAX], why[DIT_DIAG_MAX];
    const grpc_status_code code = lora_path(s, lr->name, path, sizeof path, why, sizeof why);
    if (code != GRPC_STATUS_OK) {
        refuse(&rp, code, "%s", why);
        goto done;
    }
    if (kind == JOB_LORA_UNLOAD && lora_preloaded(s, lr->name)) {
        refuse(&rp, GRPC_STATUS_FAILED_PRECONDITION,
               "'%s' is preloaded (ditd --lora) and stays loaded", lr->name);
        goto done;
    }
    for (int i = 0; kind == JOB_LORA_UNLOAD && i < s->cfg->n_preload_loras; i++)
        if (strcmp(s->cfg->preload_loras[i].path, path) == 0) {
            /* The workers keep adapters by file: unloading this name would
             * unload the preloaded one. */
            refuse(&rp, GRPC_STATUS_FAILED_PRECONDITION,
                   "'%s' is the file of the preloaded adapter '%s' (ditd --lora), which stays "
                   "loaded",
                   lr->name, s->cfg->preload_loras[i].name);
            goto done;
        }
    if (!admit(s, call, 1, &rp))
        goto done;
    r = malloc(sizeof *r);
    Ditserve__V1__LoraUse **uses = malloc(sizeof *uses);
    Ditserve__V1__LoraUse *use = malloc(sizeof *use);
    char *name = strdup(lr->name);
    if (!r || !uses || !use || !name) {
        free(r);
        free(uses);
        free(use);
        free(name);
        r = NULL;
        refuse(&rp, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        goto done;
    }
    ditserve__v1__generate_request__init(r);
    ditserve__v1__lora_use__init(use);
    use->name = name;
    uses[0] = use;
    r->loras = uses;
    r->n_loras = 1;
    job *j = new_job(s, kind, r, call);
    if (!j) {
        refuse(&rp, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        goto done;
    }
    r = NULL;
    enqueue(s, j);
    try_dispatch(s);
done:
    if (rp.code != GRPC_STATUS_OK)
        dit_rpc_call_finish(call, rp.code, rp.msg);
    if (r)
        ditserve__v1__generate_request__free_unpacked(r, NULL);
    if (lr)
        ditserve__v1__load_lora_request__free_unpacked(lr, NULL);
}

static void on_load_lora(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    lora_op(ctx, call, req, len, JOB_LORA_LOAD);
}

static void on_unload_lora(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    lora_op(ctx, call, req, len, JOB_LORA_UNLOAD);
}

static void lora_done(dit_server *s, job *j, dit_status st, grpc_status_code code,
                      const char *detail, double compute_ms)
{
    const char *name = j->req->loras[0]->name;
    DIT_LOG(s->log, st == DIT_OK ? DIT_LOG_INFO : DIT_LOG_WARN, "lora", "%s %s: %s",
            j->kind == JOB_LORA_LOAD ? "load" : "unload", name, st == DIT_OK ? "done" : detail);
    if (!j->call || st != DIT_OK) {
        fail_job(j, code, detail);
        return;
    }
    if (j->kind == JOB_LORA_LOAD) {
        Ditserve__V1__LoraInfo li;
        lora_info_of(s, name, &li);
        Ditserve__V1__LoadLoraResponse r = DITSERVE__V1__LOAD_LORA_RESPONSE__INIT;
        r.lora = &li;
        r.elapsed_ms = compute_ms;
        dit_rpc_call_send_message(j->call, &r.base);
    } else {
        Ditserve__V1__UnloadLoraResponse r = DITSERVE__V1__UNLOAD_LORA_RESPONSE__INIT;
        r.was_loaded = j->was_loaded;
        dit_rpc_call_send_message(j->call, &r.base);
    }
    fail_job(j, GRPC_STATUS_OK, NULL);
}

/* One job of the batch that ended: st and message are its own (the
 * whole job's when that failed), d its result (NULL without one). */
/* full: why the member's client has no room for its result (unread_ok's
 * refusal, judged before any result of its batch was queued), or NULL. */
static void member_done(dit_server *s, dit_server_mesh *m, job *j, dit_status st,
                        const char *message, const Ditserve__Ipc__JobDone *d, held_result *held,
                        double compute_ms, const reply *full)
{
    grpc_status_code code = dit_status_to_grpc(st);
    char detail[1300];
    if (st == DIT_OK && j->warning[0])
        snprintf(detail, sizeof detail, "warning: %s", j->warning);
    else if (st == DIT_OK)
        detail[0] = '\0';
    else if (st == DIT_ERR_CANCELLED) /* the workers only know that they stopped */
        snprintf(detail, sizeof detail, "%s", j->cancel_reason[0] ? j->cancel_reason : "cancelled");
    else if (code == GRPC_STATUS_UNAVAILABLE)
        snprintf(detail, sizeof detail, "the worker mesh failed: %s", message ? message : "");
    else
        snprintf(detail, sizeof detail, "%s", message && *message ? message : dit_status_str(st));
    switch (j->kind) {
    case JOB_STARTUP_WARMUP:
        if (st == DIT_OK || code != GRPC_STATUS_UNAVAILABLE) {
            /* A warm-up that failed for a reason other than the mesh would
             * fail again: serve anyway, and say so. */
            m->warmed = true;
            s->warmed = true;
            DIT_LOG(s->log, st == DIT_OK ? DIT_LOG_INFO : DIT_LOG_WARN, "warmup",
                    "warm-up%s%s %s in %.0f ms%s%s", s->n_meshes > 1 ? " of " : "",
                    s->n_meshes > 1 ? m->name : "", st == DIT_OK ? "done" : "failed", compute_ms,
                    st == DIT_OK ? "" : ": ", detail);
        }
        break;
    case JOB_WARMUP:
        if (j->call && st == DIT_OK) {
            Ditserve__V1__WarmupResponse wr = DITSERVE__V1__WARMUP_RESPONSE__INIT;
            wr.elapsed_ms = compute_ms;
            char text[200];
            if (j->frames > 1)
                snprintf(text, sizeof text, "ran %dx%d, %d frames, for %d step(s)", j->width,
                         j->height, j->frames, j->steps);
            else
                snprintf(text, sizeof text, "ran %dx%d for %d step(s)", j->width, j->height,
                         j->steps);
            wr.detail = text;
            dit_rpc_call_send_message(j->call, &wr.base);
            fail_job(j, GRPC_STATUS_OK, NULL);
        } else {
            fail_job(j, code, detail);
        }
        break;
    case JOB_LORA_LOAD:
    case JOB_LORA_UNLOAD:
        lora_done(s, j, st, code, detail, compute_ms);
        break;
    case JOB_GENERATE: {
        if (j->call)
            dit_rpc_call_set_user(j->call, NULL);
        if (j->told >= 0) {
            /* Its client heard already (it cancelled, or a shutdown failed
             * it), maybe before the batch it ran in reached a step boundary:
             * the log and metrics say what the client was told. */
            code = (grpc_status_code)j->told;
            st = DIT_ERR_CANCELLED;
            snprintf(detail, sizeof detail, "%s",
                     j->cancel_reason[0] ? j->cancel_reason : "cancelled");
        }
        if (st == DIT_OK && !d) {
            st = DIT_ERR_INTERNAL;
            code = GRPC_STATUS_INTERNAL;
            snprintf(detail, sizeof detail, "the workers sent no result for this request");
        }
        if (st == DIT_OK && j->call && full) {
            /* Admitted while there was room; the client has not read since. */
            dit_rpc_call_finish(j->call, full->code, full->msg);
            j->call = NULL;
            code = GRPC_STATUS_RESOURCE_EXHAUSTED;
            snprintf(detail, sizeof detail, "the result was dropped: too many unread results");
            s->requests_failed++;
        } else if (st == DIT_OK) {
            s->requests_ok++;
            send_result(s, j, d, held);
            fail_job(j, GRPC_STATUS_OK, NULL);
        } else {
            s->requests_failed++;
            fail_job(j, code, detail);
        }
        char lor[1200];
        dit_log_request(s->log, j->request_id, s->cfg->model_name, j->width, j->height, j->steps,
                        loras_text(j->req, lor, sizeof lor), j->started_ms - j->arrived_ms,
                        compute_ms, dit_rpc_status_name(code), detail);
        dit_metrics_request(s->metrics, dit_rpc_status_name(code),
                            (j->started_ms - j->arrived_ms) / 1e3,
                            (now_ms() - j->arrived_ms) / 1e3);
        break;
    }
    }
}

/* A member's result in rank 0's JobDone: its entry in `batch` (a batched
 * job, or a single one whose images several ranks decoded), or the message
 * itself (a single job); NULL when it is missing. */
static const Ditserve__Ipc__JobDone *member_result(const Ditserve__Ipc__JobDone *d, uint64_t id,
                                                   int n)
{
    if (!d)
        return NULL;
    if (n == 1 && d->n_batch == 0)
        return d;
    for (size_t i = 0; i < d->n_batch; i++)
        if (d->batch[i] && d->batch[i]->job_id == id)
            return d->batch[i];
    return NULL;
}

static void on_done(void *ctx, uint64_t job_id, dit_status st, const char *message,
                    Ditserve__Ipc__Envelope *env)
{
    dit_server_mesh *m = ctx;
    dit_server *s = m->srv;
    if (m->n_members == 0 || m->job_id != job_id) {
        if (env)
            ditserve__ipc__envelope__free_unpacked(env, NULL);
        return;
    }
    const int n = m->n_members;
    job *b[DIT_DAEMON_MAX_BATCH];
    memcpy(b, m->members, sizeof(job *) * (size_t)n);
    memset(m->members, 0, sizeof m->members);
    s->n_running -= n;
    m->n_members = 0;
    m->job_id = 0;
    const double t = now_ms();
    m->busy_ms += t - m->busy_since_ms;
    dit_metrics_mesh_busy(s->metrics, m->index, (t - m->busy_since_ms) / 1e3);
    m->busy_since_ms = 0;
    m->jobs_run++;
    m->requests_run += n;
    const Ditserve__Ipc__JobDone *done = st == DIT_OK && env ? env->done : NULL;
    /* Without memory for the hold, chunks are packed copies and env goes
     * here. */
    held_result *held = env ? held_new(env) : NULL;
    /* Whether each member's client has room for its result is judged
     * before any result of the batch is queued: members that finish
     * together do not count against each other (on one connection, the
     * client could not have read the first before the second was judged). */
    reply *full = NULL;
    bool no_room[DIT_DAEMON_MAX_BATCH] = {false};
    for (int k = 0; k < n; k++) {
        job *j = b[k];
        if (j->kind != JOB_GENERATE || !j->call || j->told >= 0)
            continue;
        if (!full && !(full = malloc(sizeof *full * (size_t)n)))
            break; /* without memory to say why, results go out */
        no_room[k] = !unread_ok(s, j->call, &full[k]);
    }
    for (int k = 0; k < n; k++) {
        job *j = b[k];
        const Ditserve__Ipc__JobDone *d = member_result(done, j->id, n);
        dit_status mst = st;
        const char *msg = message;
        if (st == DIT_OK && d) {
            mst = (dit_status)d->status;
            msg = d->message;
        }
        member_done(s, m, j, mst, msg, mst == DIT_OK ? d : NULL, held, t - j->started_ms,
                    no_room[k] ? &full[k] : NULL);
        job_free(j);
    }
    free(full);
    if (held)
        held_release(held);
    else if (env)
        ditserve__ipc__envelope__free_unpacked(env, NULL);
    update_health(s);
    try_dispatch(s);
}

static void loras_loaded_clear(dit_server_mesh *m)
{
    for (int i = 0; i < m->n_loras_loaded; i++)
        free(m->loras_loaded[i].path);
    free(m->loras_loaded);
    m->loras_loaded = NULL;
    m->n_loras_loaded = 0;
}

static void on_worker_memory(void *ctx, int rank, const Ditserve__Ipc__WorkerMemory *mem)
{
    dit_server_mesh *m = ctx;
    dit_server *s = m->srv;
    if (rank == 0) {
        /* Rank 0 speaks for its mesh: every rank of a mesh loads the same
         * adapters. Each mesh has its own cache. */
        loras_loaded_clear(m);
        const size_t n = mem->n_loras < 4096 ? mem->n_loras : 4096;
        m->loras_loaded = n ? calloc(n, sizeof *m->loras_loaded) : NULL;
        for (size_t i = 0; m->loras_loaded && i < n; i++) {
            char *p = strdup(mem->loras[i]->path ? mem->loras[i]->path : "");
            if (!p)
                break;
            m->loras_loaded[m->n_loras_loaded].path = p;
            m->loras_loaded[m->n_loras_loaded++].bytes = mem->loras[i]->bytes;
        }
        /* Counters since the worker's mesh came up: a smaller one means a
         * new mesh, counted from zero. */
        const int64_t now[3] = {mem->lora_loads, mem->lora_hits, mem->lora_evictions};
        int64_t d[3], bytes = 0, cached = 0;
        for (int k = 0; k < 3; k++) {
            d[k] = now[k] >= m->lora_counts[k] ? now[k] - m->lora_counts[k] : now[k];
            m->lora_counts[k] = now[k];
        }
        /* The gauges: every mesh's cache. */
        for (int k = 0; k < s->n_meshes; k++) {
            cached += s->meshes[k].n_loras_loaded;
            for (int i = 0; i < s->meshes[k].n_loras_loaded; i++)
                bytes += s->meshes[k].loras_loaded[i].bytes;
        }
        dit_metrics_lora(s->metrics, d[0], d[1], d[2], cached, bytes);
    }
    dit_metrics_worker_memory(s->metrics, m->index, rank, mem->host_rss_bytes,
                              mem->device_used_bytes, mem->device_total_bytes,
                              mem->device_peak_bytes);
}

dit_status dit_server_create_meshes(dit_server *s, const dit_supervisor_config *base,
                                    dit_diag *diag)
{
    const int M = s->cfg->replicas > 0 ? s->cfg->replicas : 1;
    uv_timer_init(s->loop, &s->batch_timer);
    s->batch_timer.data = s;
    s->batch_timer_up = true;
    for (int i = 0; i < M; i++) {
        dit_server_mesh *m = &s->meshes[i];
        m->srv = s;
        m->index = i;
        m->warmed = s->cfg->warmup == NULL;
        if (M > 1)
            snprintf(m->name, sizeof m->name, "mesh%d", i);
        else
            snprintf(m->name, sizeof m->name, "mesh");
        dit_supervisor_config sc = *base;
        sc.name = m->name;
        sc.device_base = i * base->pc.world_size;
        sc.meshes = M;
        const dit_supervisor_events ev = {.ctx = m,
                                          .state_changed = on_state,
                                          .job_progress = on_progress,
                                          .job_done = on_done,
                                          .worker_memory = on_worker_memory};
        const dit_status st = dit_supervisor_create(s->loop, &sc, &ev, &m->sup, diag);
        if (st != DIT_OK)
            return st;
        s->n_meshes = i + 1;
    }
    return DIT_OK;
}

void dit_server_start_meshes(dit_server *s)
{
    for (int i = 0; i < s->n_meshes; i++)
        dit_supervisor_start(s->meshes[i].sup);
}

static void on_one_mesh_stopped(void *ctx)
{
    dit_server *s = ctx;
    if (--s->meshes_stopping == 0 && s->meshes_stopped)
        s->meshes_stopped(s->meshes_stopped_ctx);
}

void dit_server_stop_meshes(dit_server *s, double grace_s, void (*done)(void *ctx), void *ctx)
{
    if (s->batch_timer_up) {
        s->batch_timer_up = false;
        uv_timer_stop(&s->batch_timer);
        uv_close((uv_handle_t *)&s->batch_timer, NULL);
    }
    s->meshes_stopped = done;
    s->meshes_stopped_ctx = ctx;
    /* Counted first: a mesh may report stopped at once. */
    s->meshes_stopping = s->n_meshes + 1;
    for (int i = 0; i < s->n_meshes; i++)
        dit_supervisor_stop(s->meshes[i].sup, grace_s, on_one_mesh_stopped, s);
    on_one_mesh_stopped(s);
}

void dit_server_destroy_meshes(dit_server *s)
{
    for (int i = 0; i < s->n_meshes; i++) {
        dit_supervisor_destroy(s->meshes[i].sup);
        s->meshes[i].sup = NULL;
        loras_loaded_clear(&s->meshes[i]);
    }
    s->n_meshes = 0;
}

int dit_server_join_port(const dit_server *s)
{
    return s->n_meshes > 0 ? dit_supervisor_join_port(s->meshes[0].sup) : -1;
}

/* ------------------------------------------------------------------------ */
/* Info, models, reflection                                                  */

/* ditserve.v1.ModelInfo from the served pipeline's description; the
 * pointers point into m, rules and entries (the caller's storage). */
typedef struct model_msg {
    Ditserve__V1__ModelInfo info;
    Ditserve__V1__LayoutRules rules;
    Ditserve__V1__ModelInfo__ConfigEntry entries[DIT_MODEL_MAX_CONFIG];
    Ditserve__V1__ModelInfo__ConfigEntry *entry_ptrs[DIT_MODEL_MAX_CONFIG];
} model_msg;

static void fill_model_info(const dit_server *s, model_msg *out)
{
    const dit_model_info *m = &s->model;
    ditserve__v1__model_info__init(&out->info);
    ditserve__v1__layout_rules__init(&out->rules);
    Ditserve__V1__ModelInfo *mi = &out->info;
    mi->name = (char *)s->cfg->model_name;
    mi->pipeline = (char *)m->pipeline_class;
    mi->transformer = (char *)m->transformer_class;
    mi->task = m->task == DIT_TASK_TEXT_TO_VIDEO ? DITSERVE__V1__TASK__TASK_TEXT_TO_VIDEO
                                                 : DITSERVE__V1__TASK__TASK_TEXT_TO_IMAGE;
    mi->has_text_encoders = m->has_text_encoders;
    mi->default_width = m->default_width;
    mi->default_height = m->default_height;
    mi->default_steps = m->default_steps;
    mi->default_num_frames = m->default_num_frames;
    mi->default_fps = m->default_fps;
    out->rules.size_multiple = m->size_multiple;
    out->rules.pixels_per_token = m->pixels_per_token;
    out->rules.token_divisor = m->token_divisor;
    out->rules.max_pixels = m->max_pixels;
    out->rules.max_steps = m->max_steps;
    out->rules.max_sequence_length = m->max_sequence_length;
    out->rules.frame_step = m->frame_step;
    mi->layout = &out->rules;
    for (int i = 0; i < m->n_config; i++) {
        ditserve__v1__model_info__config_entry__init(&out->entries[i]);
        out->entries[i].key = (char *)m->config[i].key;
        out->entries[i].value = m->config[i].value;
        out->entry_ptrs[i] = &out->entries[i];
    }
    mi->n_config = (size_t)m->n_config;
    mi->config = out->entry_ptrs;
}

static void on_server_info(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)req;
    (void)len;
    dit_server *s = ctx;
    const dit_parallel_config *pc = &s->cfg->pc;
    Ditserve__V1__ParallelLayout lay = DITSERVE__V1__PARALLEL_LAYOUT__INIT;
    lay.ring_degree = pc->ring_degree;
    lay.ulysses_degree = pc->ulysses_degree;
    lay.tp_degree = pc->tp_degree;
    lay.cfg_degree = pc->cfg_degree;
    lay.ulysses_anything = pc->ulysses_anything;
    lay.ring_anything = pc->ring_anything;
    lay.unified_anything = pc->unified_anything;
    Ditserve__V1__ServerInfo info = DITSERVE__V1__SERVER_INFO__INIT;
    info.version = DIT_VERSION;
    info.world_size = pc->world_size;
    info.layout = &lay;
    info.backend = (char *)s->cfg->backend_name;
    /* Mesh 0's devices at the top (what clients of one mesh read), every
     * mesh's in its MeshInfo. */
    enum { MAXR = 64 };
    static const int max_names = DIT_DAEMON_MAX_REPLICAS * MAXR;
    char(*names)[128] = calloc((size_t)max_names, sizeof *names);
    char **devices = calloc((size_t)max_names, sizeof *devices);
    Ditserve__V1__MeshInfo mi[DIT_DAEMON_MAX_REPLICAS], *mip[DIT_DAEMON_MAX_REPLICAS];
    if (!names || !devices) {
        free(names);
        free(devices);
        dit_rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    const int W = pc->world_size < MAXR ? pc->world_size : MAXR;
    dit_mesh_state best = DIT_MESH_STOPPED;
    bool warming = false;
    int64_t restarts = 0;
    for (int i = 0; i < s->n_meshes; i++) {
        const dit_server_mesh *ms = &s->meshes[i];
        const dit_mesh_state st = dit_supervisor_state(ms->sup);
        best = st < best ? st : best; /* starting < ready < restarting < ... */
        if (st == DIT_MESH_READY)
            best = DIT_MESH_READY;
        warming |= st == DIT_MESH_READY && !ms->warmed;
        restarts += dit_supervisor_restarts(ms->sup);
        ditserve__v1__mesh_info__init(&mi[i]);
        mi[i].index = i;
        mi[i].state = (char *)mesh_state_text(s, ms);
        for (int r = 0; r < W; r++) {
            char *nm = names[i * MAXR + r];
            snprintf(nm, sizeof *names, "rank %d: %s", r, dit_supervisor_device(ms->sup, r));
            devices[i * MAXR + r] = nm;
        }
        mi[i].n_devices = (size_t)W;
        mi[i].devices = devices + i * MAXR;
        mi[i].running = ms->n_members;
        mi[i].worker_restarts = dit_supervisor_restarts(ms->sup);
        mi[i].busy_seconds =
            (ms->busy_ms + (ms->n_members ? now_ms() - ms->busy_since_ms : 0)) / 1e3;
        mi[i].jobs = ms->jobs_run;
        mi[i].requests = ms->requests_run;
        mip[i] = &mi[i];
    }
    info.n_devices = (size_t)W;
    info.devices = devices;
    info.queue_depth = dit_queue_length(&s->queue);
    info.max_queue = s->cfg->max_queue;
    info.running = s->n_running;
    /* Health says NOT_SERVING while the startup warm-up runs on a ready
     * mesh; "ready" here would contradict it without saying why. */
    if (s->draining)
        info.mesh_state = "draining";
    else if (best == DIT_MESH_READY && warming && !any_mesh_serving(s))
        info.mesh_state = "warming_up";
    else
        info.mesh_state = (char *)dit_mesh_state_name(best);
    info.comm = pc->world_size == 1 ? "none" : s->cfg->backend == DIT_BACKEND_CUDA ? "nccl" : "shm";
    info.worker_restarts = restarts;
    info.replicas = s->n_meshes;
    info.max_batch = s->cfg->max_batch;
    info.n_meshes = (size_t)s->n_meshes;
    info.meshes = mip;
    model_msg m;
    fill_model_info(s, &m);
    info.model = &m.info;
    dit_rpc_call_send_message(call, &info.base);
    dit_rpc_call_finish(call, GRPC_STATUS_OK, NULL);
    free(names);
    free(devices);
}

static void on_list_models(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)req;
    (void)len;
    dit_server *s = ctx;
    model_msg m;
    fill_model_info(s, &m);
    Ditserve__V1__ModelInfo *list[1] = {&m.info};
    Ditserve__V1__ListModelsResponse resp = DITSERVE__V1__LIST_MODELS_RESPONSE__INIT;
    resp.n_models = 1;
    resp.models = list;
    dit_rpc_call_send_message(call, &resp.base);
    dit_rpc_call_finish(call, GRPC_STATUS_OK, NULL);
}

static void on_reflection_call(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx;
    (void)req;
    (void)len;
    dit_rpc_call_read(call);
}

/* Unread bytes on its connection past which a reflection stream takes no
 * more requests (answers it does not read would pile up, and count
 * against --max-unread-total, which refuses everyone's Generate calls). */
#define REFLECTION_MAX_UNSENT ((int64_t)1 << 20)

static void on_reflection_message(void *ctx, dit_rpc_call *call, const uint8_t *msg, size_t len)
{
    dit_server *s = ctx;
    if (!msg) {
        dit_rpc_call_finish(call, GRPC_STATUS_OK, NULL);
        return;
    }
    if (dit_rpc_call_conn_unsent(call) > REFLECTION_MAX_UNSENT) {
        dit_rpc_call_finish(
            call, GRPC_STATUS_RESOURCE_EXHAUSTED,
            "over 1 MiB unread on this connection: read the answers before asking more");
        return;
    }
    uint8_t *resp;
    size_t rlen;
    if (dit_reflection_answer(s->refl, msg, len, &resp, &rlen) != 0) {
        dit_rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "not a ServerReflectionRequest");
        return;
    }
    dit_rpc_call_send(call, resp, rlen);
    free(resp);
    dit_rpc_call_read(call);
}

/* ------------------------------------------------------------------------ */

int dit_server_methods(dit_server *s, const dit_rpc_method **out)
{
    /* Every request but Generate's is a few names and numbers: 16 KiB is
     * far more than any needs (reflection's symbol and file names, 64 KiB). */
    const int64_t small = 16 << 10, refl = 64 << 10;
    const dit_rpc_method m[] = {
        {"/ditserve.v1.Generation/Generate", DIT_RPC_SERVER_STREAM, false, on_generate, NULL,
         on_job_cancel, s, 0},
        {"/ditserve.v1.Generation/ListModels", DIT_RPC_UNARY, false, on_list_models, NULL, NULL, s,
         small},
        {"/ditserve.v1.Generation/GetServerInfo", DIT_RPC_UNARY, false, on_server_info, NULL, NULL,
         s, small},
        {"/ditserve.v1.Generation/Warmup", DIT_RPC_UNARY, false, on_warmup, NULL, on_job_cancel, s,
         small},
        {"/ditserve.v1.Generation/ListLoras", DIT_RPC_UNARY, false, on_list_loras, NULL, NULL, s,
         small},
        {"/ditserve.v1.Generation/LoadLora", DIT_RPC_UNARY, false, on_load_lora, NULL,
         on_job_cancel, s, small},
        {"/ditserve.v1.Generation/UnloadLora", DIT_RPC_UNARY, false, on_unload_lora, NULL,
         on_job_cancel, s, small},
        {"/grpc.health.v1.Health/Check", DIT_RPC_UNARY, true, on_health_check, NULL, NULL, s,
         small},
        {"/grpc.health.v1.Health/Watch", DIT_RPC_SERVER_STREAM, true, on_health_watch, NULL,
         on_health_watch_cancel, s, small},
        {"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", DIT_RPC_BIDI_STREAM, false,
         on_reflection_call, on_reflection_message, NULL, s, refl},
        {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", DIT_RPC_BIDI_STREAM,
         false, on_reflection_call, on_reflection_message, NULL, s, refl},
    };
    _Static_assert(sizeof m == sizeof s->methods, "dit_server.methods has room for every method");
    memcpy(s->methods, m, sizeof m);
    *out = s->methods;
    return (int)(sizeof m / sizeof *m);
}

void dit_server_drain(dit_server *s)
{
    s->draining = true;
    /* A drain runs what was accepted, at once: a startup warm-up (queued,
     * or running while requests wait: health says NOT_SERVING during it,
     * but a ready mesh admits them) would only spend the drain's time
     * before them, and they could end at --drain-timeout. */
    for (dit_queue_item *it = dit_queue_peek(&s->queue); it;) {
        job *j = JOB_OF(it);
        it = dit_queue_next(it);
        if (j->kind == JOB_STARTUP_WARMUP) {
            dit_queue_remove(&s->queue, &j->qi);
            job_free(j);
        }
    }
    for (int i = 0; i < s->n_meshes; i++) {
        dit_server_mesh *m = &s->meshes[i];
        m->warmed = true;
        /* One running: it stops at its next step, and the mesh takes the
         * accepted requests. */
        if (m->n_members == 1 && m->members[0]->kind == JOB_STARTUP_WARMUP) {
            snprintf(m->members[0]->cancel_reason, sizeof m->members[0]->cancel_reason,
                     "the server is shutting down");
            dit_supervisor_cancel(m->sup, m->members[0]->id);
        }
    }
    update_positions(s);
    update_health(s);
    try_dispatch(s);
}

int dit_server_pending(const dit_server *s)
{
    return dit_queue_length(&s->queue) + s->n_running;
}

void dit_server_abort_pending(dit_server *s, const char *why)
{
    dit_queue_item *it;
    while ((it = dit_queue_pop(&s->queue)) != NULL) {
        job *j = JOB_OF(it);
        log_unrun(s, j, GRPC_STATUS_UNAVAILABLE, why);
        fail_job(j, GRPC_STATUS_UNAVAILABLE, why);
        job_free(j);
    }
    update_positions(s);
    for (int i = 0; i < s->n_meshes; i++)
        for (int k = 0; k < s->meshes[i].n_members; k++) {
            /* The client hears why now; the job stops at its next step. */
            job *j = s->meshes[i].members[k];
            if (!j)
                continue;
            snprintf(j->cancel_reason, sizeof j->cancel_reason, "%s", why);
            fail_job(j, GRPC_STATUS_UNAVAILABLE, why);
            dit_supervisor_cancel(s->meshes[i].sup, j->id);
        }
}

void dit_server_free_jobs(dit_server *s)
{
    for (int i = 0; i < DIT_DAEMON_MAX_REPLICAS; i++)
        loras_loaded_clear(&s->meshes[i]);
    dit_queue_item *it;
    while ((it = dit_queue_pop(&s->queue)) != NULL)
        job_free(JOB_OF(it));
    for (int i = 0; i < DIT_DAEMON_MAX_REPLICAS; i++) {
        for (int k = 0; k < s->meshes[i].n_members; k++)
            job_free(s->meshes[i].members[k]);
        s->meshes[i].n_members = 0;
    }
    s->n_running = 0;
    free(s->watchers);
    s->watchers = NULL;
}
