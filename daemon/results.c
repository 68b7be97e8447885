#include "results.h"

#include "ipc_wire.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The ranks that hold a member's images, each with its entry. */
typedef struct holders {
    int n;
    int rank[DIT_RESULTS_MAX_IMAGES];
    Ditserve__Ipc__JobDone *entry[DIT_RESULTS_MAX_IMAGES];
    int count[DIT_RESULTS_MAX_IMAGES]; /* images it holds */
    int slot_of_image[DIT_RESULTS_MAX_IMAGES];
} holders;

static int holder_slot(holders *h, int rank)
{
    for (int i = 0; i < h->n; i++)
        if (h->rank[i] == rank)
            return i;
    h->rank[h->n] = rank;
    h->entry[h->n] = NULL;
    h->count[h->n] = 0;
    return h->n++;
}

static void swap_into_rank0(Ditserve__Ipc__JobDone *const *done, int r, size_t k)
{
    if (r == 0)
        return;
    Ditserve__Ipc__JobDone *t = done[0]->batch[k];
    done[0]->batch[k] = done[r]->batch[k];
    done[r]->batch[k] = t;
}

/* Member k's images from its holders, joined into `base` (one of them). */
static bool join_member(const holders *h, Ditserve__Ipc__JobDone *base, int n_img, size_t k,
                        char *why, size_t cap)
{
    size_t total = 0;
    for (int s = 0; s < h->n; s++) {
        const Ditserve__Ipc__JobDone *e = h->entry[s];
        if (e->n_image_bytes != (size_t)h->count[s]) {
            snprintf(why, cap, "worker rank %d sent %zu images of batch member %zu, not %d",
                     h->rank[s], e->n_image_bytes, k, h->count[s]);
            return false;
        }
        uint64_t sum = 0;
        for (size_t i = 0; i < e->n_image_bytes; i++) {
            if (e->image_bytes[i] < 0 || (uint64_t)e->image_bytes[i] > e->image.len - sum) {
                snprintf(why, cap,
                         "worker rank %d's image sizes of batch member %zu do not "
                         "add up to its %zu bytes",
                         h->rank[s], k, e->image.len);
                return false;
            }
            sum += (uint64_t)e->image_bytes[i];
        }
        if (sum != e->image.len) {
            snprintf(why, cap,
                     "worker rank %d's image sizes of batch member %zu do not add up "
                     "to its %zu bytes",
                     h->rank[s], k, e->image.len);
            return false;
        }
        if (e->image.len > SIZE_MAX - total) {
            snprintf(why, cap, "batch member %zu's images are too large", k);
            return false;
        }
        total += e->image.len;
    }
    uint8_t *buf = malloc(total ? total : 1);
    int64_t *sizes = malloc(sizeof *sizes * (size_t)n_img);
    if (!buf || !sizes) {
        free(buf);
        free(sizes);
        snprintf(why, cap, "out of memory for batch member %zu's images (%zu bytes)", k, total);
        return false;
    }
    size_t pos[DIT_RESULTS_MAX_IMAGES] = {0}, next[DIT_RESULTS_MAX_IMAGES] = {0}, off = 0;
    for (int i = 0; i < n_img; i++) {
        const int s = h->slot_of_image[i];
        const Ditserve__Ipc__JobDone *e = h->entry[s];
        const size_t len = (size_t)e->image_bytes[next[s]++];
        memcpy(buf + off, e->image.data + pos[s], len);
        pos[s] += len;
        off += len;
        sizes[i] = (int64_t)len;
    }
    /* The base's own buffers were malloc'ed by protobuf-c's default
     * allocator, which frees these in their place. */
    double vae = 0, enc = 0;
    for (int s = 0; s < h->n; s++)
        if (h->entry[s]->timings) {
            const double v = h->entry[s]->timings->vae_ms, c = h->entry[s]->timings->encode_ms;
            vae = v > vae ? v : vae;
            enc = c > enc ? c : enc;
        }
    free(base->image.data);
    base->image.data = buf;
    base->image.len = total;
    free(base->image_bytes);
    base->image_bytes = sizes;
    base->n_image_bytes = (size_t)n_img;
    if (base->timings) {
        base->timings->vae_ms = vae;
        base->timings->encode_ms = enc;
    }
    return true;
}

bool dit_results_merge(Ditserve__Ipc__JobDone *const *done, int n_ranks, const double *done_ms,
                       char *why, size_t cap)
{
    const Ditserve__Ipc__JobDone *d0 = done[0];
    double last = 0;
    for (int r = 0; r < n_ranks; r++)
        last = done_ms[r] > last ? done_ms[r] : last;
    for (size_t k = 0; k < d0->n_batch; k++) {
        const Ditserve__Ipc__JobDone *e0 = d0->batch[k];
        const size_t named = e0->n_image_ranks;
        if (named > DIT_RESULTS_MAX_IMAGES) {
            snprintf(why, cap, "worker rank 0 named %zu images of batch member %zu", named, k);
            return false;
        }
        /* Who holds which image (none named: `rank` holds them all). */
        holders h = {0};
        const int n_img = named ? (int)named : 1;
        for (int i = 0; i < n_img; i++) {
            const int r = named ? e0->image_ranks[i] : e0->rank;
            if (r < 0 || r >= n_ranks) {
                snprintf(why, cap, "worker rank 0 named rank %d for an image of batch member %zu",
                         r, k);
                return false;
            }
            const int s = holder_slot(&h, r);
            h.count[s]++;
            h.slot_of_image[i] = s;
        }
        for (int s = 0; s < h.n; s++) {
            const int r = h.rank[s];
            const Ditserve__Ipc__JobDone *dr = done[r];
            Ditserve__Ipc__JobDone *e = dr && dr->n_batch == d0->n_batch ? dr->batch[k] : NULL;
            if (!e || e->job_id != e0->job_id) {
                snprintf(why, cap, "worker rank %d did not send the result of batch member %zu", r,
                         k);
                return false;
            }
            h.entry[s] = e;
        }
        /* A failure on any holder is the member's; else its images joined
         * into the entry of image 0's holder. */
        int pick = h.slot_of_image[0];
        for (int i = 0; i < n_img; i++)
            if (h.entry[h.slot_of_image[i]]->status != 0) {
                pick = h.slot_of_image[i];
                break;
            }
        Ditserve__Ipc__JobDone *base = h.entry[pick];
        bool any = false; /* a warm-up's entries carry no images */
        for (int s = 0; s < h.n; s++)
            any = any || h.entry[s]->n_image_bytes > 0 || h.entry[s]->image.len > 0;
        if (base->status == 0 && h.n > 1 && any && !join_member(&h, base, n_img, k, why, cap))
            return false;
        swap_into_rank0(done, h.rank[pick], k);
        double held = 0;
        for (int s = 0; s < h.n; s++)
            held = done_ms[h.rank[s]] > held ? done_ms[h.rank[s]] : held;
        if (base->timings)
            base->timings->batch_others_ms += last - held;
    }
    return true;
}

size_t dit_chunk_event_head_max(const char *request_id)
{
    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.request_id = (char *)request_id;
    /* The chunk's offset and image index: a tag and at most 10 bytes each. */
    return ditserve__v1__generate_event__get_packed_size(&ev) + 2 * DIT_PB_FIELD_HEAD_MAX + 22;
}

size_t dit_chunk_event_head(const char *request_id, int64_t offset, int32_t image_index, size_t len,
                            uint8_t *out)
{
    Ditserve__V1__ResultChunk rc = DITSERVE__V1__RESULT_CHUNK__INIT;
    rc.offset = offset;
    rc.image_index = image_index;
    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.request_id = (char *)request_id;
    /* GenerateEvent.chunk = 5 and ResultChunk.data = 2, length-delimited;
     * the data empty in rc is left out of its packing. */
    const size_t body =
        ditserve__v1__result_chunk__get_packed_size(&rc) + dit_pb_field_head_size(2, len) + len;
    size_t h = ditserve__v1__generate_event__pack(&ev, out);
    h += dit_pb_field_head(out + h, 5, body);
    h += ditserve__v1__result_chunk__pack(&rc, out + h);
    h += dit_pb_field_head(out + h, 2, len);
    return h;
}
