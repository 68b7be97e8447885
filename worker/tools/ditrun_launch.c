/* ditrun: validation before launch, the mesh launcher and supervisor, and
 * the helpers rank processes share. */
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/shm/comm_shm.h"
#include "models/model.h"
#include "runtime/inputs.h"
#include "tools/ditrun.h"

extern char **environ;

double ditrun_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

bool ditrun_fault_for_rank(int rank, ditrun_fault *out)
{
    const char *fr = getenv("DIT_FAULT_KILL_RANK"), *fb = getenv("DIT_FAULT_KILL_BLOCK");
    if (!fr || !fb || atoi(fr) != rank)
        return false;
    out->block = atoi(fb);
    return true;
}

dit_status ditrun_fault_block(void *ctx, int block, dit_diag *diag)
{
    (void)diag;
    const ditrun_fault *f = ctx;
    if (block == f->block)
        raise(SIGKILL);
    return DIT_OK;
}

dit_status ditrun_join_mesh(const ditrun_args *a, int rank, dit_comm **world, dit_mesh **mesh,
                            dit_diag *diag)
{
    dit_shm_config sc = {.world_size = a->pc.world_size, .timeout_s = a->comm_timeout};
    snprintf(sc.name, sizeof sc.name, "%s", a->mesh_shm);
    dit_status st = dit_shm_comm_join(&sc, rank, world, diag);
    if (st != DIT_OK)
        return st;
    st = dit_mesh_create(&a->pc, *world, mesh, diag);
    if (st != DIT_OK) {
        (*world)->ops->abort(*world);
        dit_comm_destroy(*world);
        *world = NULL;
    }
    return st;
}

int ditrun_validate(const ditrun_args *a)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_parallel_validate(&a->pc, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun: %s\n", dit_diag_msg(&diag));
        return DITRUN_EXIT_USAGE;
    }
    if (a->backend == DIT_BACKEND_CUDA && a->pc.world_size > 1) {
        /* ditrun's rank processes talk through host shared memory, which
         * device buffers cannot use; ditd builds NCCL meshes. */
        fprintf(stderr, "ditrun: a mesh of several ranks needs --backend cpu here; run cuda "
                        "meshes with ditd (NCCL)\n");
        return DITRUN_EXIT_USAGE;
    }
    dit_parallel_req req;
    int64_t lens[DIT_PARALLEL_MAX_SEQS];
    if (a->cmd == DITRUN_FORWARD) {
        const dit_model_class *cls = NULL;
        void *cfg = NULL;
        dit_status st = dit_model_config_load(a->model, &cls, &cfg, &diag);
        if (st == DIT_OK) {
            req = cls->parallel_req(cfg);
            st = dit_input_file_peek(a->inputs, cls, cfg, lens, &diag);
        }
        free(cfg);
        if (st != DIT_OK) {
            fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
            return 1;
        }
    } else {
        dit_pipeline_info info;
        if (dit_pipeline_probe(a->model, &info, &diag) != DIT_OK) {
            fprintf(stderr, "ditrun generate: %s\n", dit_diag_msg(&diag));
            return 1;
        }
        if (dit_gen_check(&info, &a->gen, &diag) != DIT_OK) {
            fprintf(stderr, "ditrun generate: %s\n", dit_diag_msg(&diag));
            return DITRUN_EXIT_USAGE;
        }
        req = info.parallel;
        dit_gen_seq_lens(&info, &a->gen, lens);
    }
    if (a->pc.world_size > 1 && dit_parallel_validate_model(&a->pc, &req, lens, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun: %s\n", dit_diag_msg(&diag));
        return DITRUN_EXIT_USAGE;
    }
    return 0;
}

static void describe_exit(int status, char *buf, size_t cap)
{
    if (WIFEXITED(status))
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, cap, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(buf, cap, "stopped (status %d)", status);
}

int ditrun_launch(const ditrun_args *a, int argc, char **argv)
{
    const int N = a->pc.world_size;
    const char *cmd = a->cmd == DITRUN_FORWARD ? "forward" : "generate";
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_shm_config sc = {.world_size = N, .timeout_s = a->comm_timeout};
    dit_shm_make_name(&sc);
    dit_shm_segment *seg = NULL;
    if (dit_shm_segment_create(&sc, &seg, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun %s: %s\n", cmd, dit_diag_msg(&diag));
        return 1;
    }
    pid_t pids[DIT_SHM_MAX_RANKS] = {0};
    char rank_buf[DIT_SHM_MAX_RANKS][16], threads_buf[16];
    char **cargv = calloc((size_t)argc + 8, sizeof *cargv);
    if (!cargv) {
        dit_shm_segment_destroy(seg);
        return 1;
    }
    /* Ranks share the cores unless told otherwise. */
    int threads = a->threads;
    if (threads == 0) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        threads = ncpu > N ? (int)(ncpu / N) : 1;
    }
    snprintf(threads_buf, sizeof threads_buf, "%d", threads);
    int started = 0;
    for (int r = 0; r < N; r++) {
        int k = 0;
        cargv[k++] = "ditrun"; /* argv here starts at the command name */
        for (int i = 0; i < argc; i++)
            cargv[k++] = argv[i];
        snprintf(rank_buf[r], sizeof rank_buf[r], "%d", r);
        cargv[k++] = "--mesh-rank";
        cargv[k++] = rank_buf[r];
        cargv[k++] = "--mesh-shm";
        cargv[k++] = sc.name;
        cargv[k++] = "--threads";
        cargv[k++] = threads_buf;
        cargv[k] = NULL;
        int err = posix_spawn(&pids[r], "/proc/self/exe", NULL, NULL, cargv, environ);
        if (err != 0) {
            fprintf(stderr, "ditrun %s: cannot start rank %d: %s\n", cmd, r, strerror(err));
            dit_shm_segment_abort(seg, r);
            break;
        }
        started++;
    }
    free(cargv);

    int first_failed = -1, first_status = 0, alive = started;
    while (alive > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        int r = -1;
        for (int i = 0; i < started; i++)
            if (pids[i] == pid)
                r = i;
        if (r < 0)
            continue;
        alive--;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            if (first_failed < 0) {
                first_failed = r;
                first_status = status;
            }
            /* A dead rank cannot say so itself: abort the mesh for it. */
            dit_shm_segment_abort(seg, r);
        }
    }
    int rc = 0;
    if (started < N) {
        rc = 1;
    } else if (first_failed >= 0) {
        int culprit = dit_shm_segment_failed_rank(seg);
        if (culprit < 0)
            culprit = first_failed;
        char how[96];
        describe_exit(first_status, how, sizeof how);
        if (culprit == first_failed)
            fprintf(stderr, "ditrun %s: rank %d failed: it %s\n", cmd, culprit, how);
        else
            fprintf(stderr, "ditrun %s: rank %d failed first; rank %d %s\n", cmd, culprit,
                    first_failed, how);
        rc = 1;
    }
    dit_shm_segment_destroy(seg);
    return rc;
}
