/* H.264 MP4 encoding through FFmpeg's libraries, from memory to memory.
 *
 * The muxer writes into a growable buffer through a custom AVIOContext
 * (write and seek callbacks). "faststart" needs more than a seekable
 * output: after the last frame, libavformat's mov muxer knows the size of
 * the moov box, reopens the output *for reading* through
 * AVFormatContext.io_open (with the context's url) and moves every byte
 * after the reserved header up by that size, reading ahead of where it
 * writes, as it would with a file. So io_open here hands out a reader over
 * the same buffer, which behaves like a second file descriptor on that
 * file, and io_close2 frees it. This keeps everything in memory (no temporary
 * file, no /proc or memfd) and the bytes come back as one malloc'ed buffer
 * the daemon can stream.
 *
 * All state lives in one mp4_enc per call; nothing here is global. FFmpeg's
 * own messages go to its log (stderr by default); libx264's informational
 * lines are demoted below the default level through the codec context's
 * log_level_offset, and every error also comes back as a dit_diag message
 * with FFmpeg's text for the code. */
#include "media/mp4.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "media/png.h"

uint8_t dit_mp4_quantize(float x)
{
    /* torch: video / 2 + 0.5 in float32 (x / 2 == x * 0.5 exactly, so an
     * FMA contraction cannot change it), then clamp(0, 1), which keeps NaN. */
    float v = x * 0.5f + 0.5f;
    if (!(v == v))
        return 0;
    v = v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
    /* numpy: (frame * 255) in float32, then astype(uint8), which truncates
     * toward zero; p is in [0, 255] here, so the conversion is defined. */
    const float p = v * 255.0f;
    return (uint8_t)p;
}

void dit_mp4_to_rgb8(const float *frame, int64_t channel_stride, int64_t H, int64_t W, uint8_t *rgb)
{
    const int64_t plane = H * W;
    for (int64_t p = 0; p < plane; p++) {
        uint8_t *px = rgb + 3 * p;
        px[0] = dit_mp4_quantize(frame[p]);
        px[1] = dit_mp4_quantize(frame[channel_stride + p]);
        px[2] = dit_mp4_quantize(frame[2 * channel_stride + p]);
    }
}

#ifdef DIT_HAVE_MP4

#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/dict.h>
#include <libavutil/error.h>
#include <libavutil/frame.h>
#include <libavutil/log.h>
#include <libavutil/mem.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>

/* libx264 settings: CRF 18 is visually lossless for this content, preset
 * medium is x264's (and ffmpeg's) default speed/size trade-off; see
 * README.md for measured times and sizes. */
#define MP4_X264_CRF "18"
#define MP4_X264_PRESET "medium"
/* Zeroed bytes after the RGB frame (FFmpeg's input padding). */
#define MP4_RGB_PAD 64
/* The muxer's write buffer and the second-pass reader's buffer. */
#define MP4_IO_BUF (64 * 1024)

/* libavformat 61 made the write callback's buffer const. */
#if LIBAVFORMAT_VERSION_MAJOR >= 61
typedef const uint8_t mp4_wbuf;
#else
typedef uint8_t mp4_wbuf;
#endif

/* ------------------------------------------------------------------------ */
/* The output file, in memory                                                */

/* A growable byte buffer with file semantics: writes at pos overwrite or
 * extend it, seeking past the end and writing leaves zeros in the gap. */
typedef struct membuf {
    uint8_t *data;
    size_t len, cap;
    size_t pos; /* the muxer's write position */
} membuf;

/* A second-pass reader over the same bytes. */
typedef struct memreader {
    membuf *buf;
    size_t pos;
} memreader;

static int membuf_write(void *opaque, mp4_wbuf *data, int n)
{
    membuf *b = opaque;
    if (n < 0)
        return AVERROR(EINVAL);
    size_t need = (size_t)n;
    if (b->pos > SIZE_MAX / 2 || need > SIZE_MAX / 2 - b->pos)
        return AVERROR(ENOMEM);
    size_t end = b->pos + need;
    if (end > b->cap) {
        size_t cap = b->cap ? b->cap : MP4_IO_BUF;
        while (cap < end)
            cap *= 2;
        uint8_t *p = realloc(b->data, cap);
        if (!p)
            return AVERROR(ENOMEM);
        b->data = p;
        b->cap = cap;
    }
    if (b->pos > b->len)
        memset(b->data + b->len, 0, b->pos - b->len);
    if (need)
        memcpy(b->data + b->pos, data, need);
    b->pos = end;
    if (end > b->len)
        b->len = end;
    return n;
}

/* The seek of both the writer and the reader: *pos is theirs, len the
 * file's size. Positions past the end are allowed (as lseek allows them). */
static int64_t seek_pos(size_t *pos, size_t len, int64_t offset, int whence)
{
    whence &= ~AVSEEK_FORCE;
    if (whence == AVSEEK_SIZE)
        return (int64_t)len;
    int64_t base;
    switch (whence) {
    case SEEK_SET:
        base = 0;
        break;
    case SEEK_CUR:
        base = (int64_t)*pos;
        break;
    case SEEK_END:
        base = (int64_t)len;
        break;
    default:
        return AVERROR(EINVAL);
    }
    if ((offset < 0 && base + offset < 0) || (offset > 0 && offset > INT64_MAX / 2 - base))
        return AVERROR(EINVAL);
    *pos = (size_t)(base + offset);
    return (int64_t)*pos;
}

static int64_t membuf_seek(void *opaque, int64_t offset, int whence)
{
    membuf *b = opaque;
    return seek_pos(&b->pos, b->len, offset, whence);
}

static int memreader_read(void *opaque, uint8_t *data, int n)
{
    memreader *r = opaque;
    const membuf *b = r->buf;
    if (n < 0)
        return AVERROR(EINVAL);
    if (r->pos >= b->len)
        return AVERROR_EOF;
    size_t k = b->len - r->pos < (size_t)n ? b->len - r->pos : (size_t)n;
    memcpy(data, b->data + r->pos, k);
    r->pos += k;
    return (int)k;
}

static int64_t memreader_seek(void *opaque, int64_t offset, int whence)
{
    memreader *r = opaque;
    return seek_pos(&r->pos, r->buf->len, offset, whence);
}

/* AVFormatContext.io_open: the mov muxer's faststart pass reopens its
 * output for reading; anything else is refused. */
static int open_reader(AVFormatContext *s, AVIOContext **pb, const char *url, int flags,
                       AVDictionary **options)
{
    (void)url;
    (void)options;
    if ((flags & AVIO_FLAG_WRITE) || !s->opaque)
        return AVERROR(ENOSYS);
    memreader *r = av_mallocz(sizeof *r);
    uint8_t *buf = av_malloc(MP4_IO_BUF);
    AVIOContext *io =
        r && buf ? avio_alloc_context(buf, MP4_IO_BUF, 0, r, memreader_read, NULL, memreader_seek)
                 : NULL;
    if (!io) {
        av_free(buf);
        av_free(r);
        return AVERROR(ENOMEM);
    }
    r->buf = s->opaque;
    *pb = io;
    return 0;
}

/* AVFormatContext.io_close2, for what open_reader opened. */
static int close_reader(AVFormatContext *s, AVIOContext *pb)
{
    (void)s;
    if (pb) {
        av_free(pb->opaque);
        av_freep(&pb->buffer); /* avio may have replaced the one given */
        avio_context_free(&pb);
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                  */

typedef struct mp4_enc {
    membuf out;
    AVIOContext *pb;
    AVFormatContext *oc;
    AVStream *st;
    AVCodecContext *enc;
    struct SwsContext *sws;
    AVFrame *frame;
    AVPacket *pkt;
    uint8_t *rgb;
} mp4_enc;

/* An FFmpeg error code as a dit_status with FFmpeg's text. */
static dit_status av_fail(dit_diag *diag, int err, const char *what)
{
    char text[AV_ERROR_MAX_STRING_SIZE];
    if (av_strerror(err, text, sizeof text) < 0)
        snprintf(text, sizeof text, "error %d", err);
    return dit_diag_set(diag, err == AVERROR(ENOMEM) ? DIT_ERR_NOMEM : DIT_ERR_INTERNAL,
                        "mp4: %s: %s", what, text);
}

/* Moves every packet the encoder has ready into the muxer. Returns 0,
 * or AVERROR_EOF once the encoder is drained, or an error. */
static int drain(mp4_enc *e)
{
    for (;;) {
        int ret = avcodec_receive_packet(e->enc, e->pkt);
        if (ret == AVERROR(EAGAIN))
            return 0;
        if (ret < 0)
            return ret;
        if (e->pkt->duration <= 0)
            e->pkt->duration = 1; /* one frame, in the codec's 1/fps */
        av_packet_rescale_ts(e->pkt, e->enc->time_base, e->st->time_base);
        e->pkt->stream_index = e->st->index;
        ret = av_interleaved_write_frame(e->oc, e->pkt); /* takes the packet's data */
        if (ret < 0)
            return ret;
    }
}

static dit_status check_args(const float *frames, int n_frames, int height, int width, int fps,
                             uint8_t **out, size_t *out_len, dit_diag *diag)
{
    if (!frames || !out || !out_len)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "mp4: %s is NULL",
                            !frames ? "frames" : (!out ? "out" : "out_len"));
    if (n_frames < 1 || n_frames > DIT_MP4_MAX_FRAMES)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "mp4: cannot encode %d frames (1 to %d allowed)", n_frames,
                            DIT_MP4_MAX_FRAMES);
    if (width < 2 || width > DIT_MP4_MAX_SIDE || height < 2 || height > DIT_MP4_MAX_SIDE)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "mp4: cannot encode %d x %d (height x width) frames: each side must "
                            "be 2 to %d",
                            height, width, DIT_MP4_MAX_SIDE);
    if (width % 2 || height % 2)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "mp4: cannot encode %d x %d (height x width) frames: yuv420p needs "
                            "an even height and width",
                            height, width);
    if (fps < 1 || fps > DIT_MP4_MAX_FPS)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "mp4: fps %d out of range (1 to %d)", fps,
                            DIT_MP4_MAX_FPS);
    return DIT_OK;
}

/* The muxer over e->out, the encoder and its stream. */
static dit_status open_output(mp4_enc *e, int height, int width, int fps, dit_diag *diag)
{
    const AVCodec *codec = avcodec_find_encoder_by_name("libx264");
    const bool x264 = codec != NULL;
    if (!codec)
        codec = avcodec_find_encoder(AV_CODEC_ID_H264);
    if (!codec)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "mp4: this FFmpeg has no H.264 encoder (libx264 is not built in)");

    int ret = avformat_alloc_output_context2(&e->oc, NULL, "mp4", NULL);
    if (ret < 0 || !e->oc)
        return av_fail(diag, ret < 0 ? ret : AVERROR(ENOMEM), "cannot set up the mp4 muxer");
    uint8_t *iobuf = av_malloc(MP4_IO_BUF);
    e->pb = iobuf
                ? avio_alloc_context(iobuf, MP4_IO_BUF, 1, &e->out, NULL, membuf_write, membuf_seek)
                : NULL;
    if (!e->pb) {
        av_free(iobuf);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "mp4: out of memory");
    }
    e->oc->pb = e->pb;
    e->oc->flags |= AVFMT_FLAG_CUSTOM_IO;
    e->oc->opaque = &e->out;
    e->oc->io_open = open_reader;
    e->oc->io_close2 = close_reader;
    av_freep(&e->oc->url);
    e->oc->url = av_strdup("memory"); /* only shown in FFmpeg's messages */

    e->st = avformat_new_stream(e->oc, NULL);
    e->enc = avcodec_alloc_context3(codec);
    if (!e->st || !e->enc || !e->oc->url)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "mp4: out of memory");
    AVCodecContext *c = e->enc;
    c->width = width;
    c->height = height;
    c->pix_fmt = AV_PIX_FMT_YUV420P;
    c->time_base = (AVRational){1, fps};
    c->framerate = (AVRational){fps, 1};
    c->sample_aspect_ratio = (AVRational){1, 1};
    /* What libswscale converts with below, so players convert back alike. */
    c->colorspace = AVCOL_SPC_SMPTE170M;
    c->color_range = AVCOL_RANGE_MPEG;
    /* libx264's banner and statistics (info level) stay out of the log. */
    c->log_level_offset = AV_LOG_VERBOSE - AV_LOG_INFO;
    if (e->oc->oformat->flags & AVFMT_GLOBALHEADER)
        c->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
    if (x264) {
        if ((ret = av_opt_set(c->priv_data, "crf", MP4_X264_CRF, 0)) < 0 ||
            (ret = av_opt_set(c->priv_data, "preset", MP4_X264_PRESET, 0)) < 0)
            return av_fail(diag, ret, "cannot set libx264's options");
    }
    if ((ret = avcodec_open2(c, codec, NULL)) < 0) {
        char what[128];
        snprintf(what, sizeof what, "cannot open the %s encoder for %d x %d at %d fps", codec->name,
                 height, width, fps);
        return av_fail(diag, ret, what);
    }
    if ((ret = avcodec_parameters_from_context(e->st->codecpar, c)) < 0)
        return av_fail(diag, ret, "cannot copy the encoder's parameters");
    e->st->time_base = c->time_base;
    e->st->avg_frame_rate = c->framerate;

    AVDictionary *opts = NULL;
    if ((ret = av_dict_set(&opts, "movflags", "+faststart", 0)) >= 0)
        ret = avformat_write_header(e->oc, &opts);
    av_dict_free(&opts);
    if (ret < 0)
        return av_fail(diag, ret, "cannot write the mp4 header");
    return DIT_OK;
}

/* RGB24 -> yuv420p: libswscale with ffmpeg's default bicubic filter and
 * BT.601 matrix, full-range RGB in, limited-range YUV out. */
static dit_status open_converter(mp4_enc *e, int height, int width, dit_diag *diag)
{
    e->sws = sws_getContext(width, height, AV_PIX_FMT_RGB24, width, height, AV_PIX_FMT_YUV420P,
                            SWS_BICUBIC, NULL, NULL, NULL);
    if (!e->sws)
        return dit_diag_set(diag, DIT_ERR_INTERNAL,
                            "mp4: libswscale cannot convert %d x %d RGB24 to yuv420p", height,
                            width);
    const int *bt601 = sws_getCoefficients(SWS_CS_ITU601);
    if (sws_setColorspaceDetails(e->sws, bt601, 1, bt601, 0, 0, 1 << 16, 1 << 16) < 0)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "mp4: libswscale refused the BT.601 matrix");
    e->frame = av_frame_alloc();
    e->pkt = av_packet_alloc();
    /* libswscale's SIMD input readers load 16 bytes at a time and run past
     * the last row's end: zeroed padding keeps them inside the buffer, and
     * the output independent of whatever memory follows it. */
    e->rgb = calloc(1, (size_t)height * (size_t)width * 3 + MP4_RGB_PAD);
    if (!e->frame || !e->pkt || !e->rgb)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "mp4: out of memory");
    e->frame->format = AV_PIX_FMT_YUV420P;
    e->frame->width = width;
    e->frame->height = height;
    int ret = av_frame_get_buffer(e->frame, 0);
    if (ret < 0)
        return av_fail(diag, ret, "cannot allocate a frame");
    return DIT_OK;
}

static void close_enc(mp4_enc *e)
{
    free(e->rgb);
    av_packet_free(&e->pkt);
    av_frame_free(&e->frame);
    sws_freeContext(e->sws);
    avcodec_free_context(&e->enc);
    avformat_free_context(e->oc); /* AVFMT_FLAG_CUSTOM_IO: leaves pb alone */
    if (e->pb) {
        av_freep(&e->pb->buffer);
        avio_context_free(&e->pb);
    }
    free(e->out.data);
}

dit_status dit_mp4_encode(const float *frames, int n_frames, int height, int width, int fps,
                          uint8_t **out, size_t *out_len, dit_diag *diag)
{
    dit_status st = check_args(frames, n_frames, height, width, fps, out, out_len, diag);
    if (st != DIT_OK)
        return st;
    mp4_enc e;
    memset(&e, 0, sizeof e);
    DIT_CHECK(open_output(&e, height, width, fps, diag));
    DIT_CHECK(open_converter(&e, height, width, diag));

    /* (3, F, H, W): frame i's channel c is the plane at (c F + i) H W. */
    const size_t plane = (size_t)height * (size_t)width;
    /* sws_scale reads four planes' pointers and strides, even for packed RGB. */
    const uint8_t *src[4] = {e.rgb, NULL, NULL, NULL};
    const int src_stride[4] = {3 * width, 0, 0, 0};
    int ret;
    for (int i = 0; i < n_frames; i++) {
        dit_mp4_to_rgb8(frames + (size_t)i * plane, (int64_t)(plane * (size_t)n_frames), height,
                        width, e.rgb);
        /* The encoder may still hold the previous picture. */
        if ((ret = av_frame_make_writable(e.frame)) < 0) {
            st = av_fail(diag, ret, "cannot allocate a frame");
            goto cleanup;
        }
        sws_scale(e.sws, src, src_stride, 0, height, e.frame->data, e.frame->linesize);
        e.frame->pts = i;
        if ((ret = avcodec_send_frame(e.enc, e.frame)) < 0 || (ret = drain(&e)) < 0) {
            char what[64];
            snprintf(what, sizeof what, "encoding frame %d failed", i);
            st = av_fail(diag, ret, what);
            goto cleanup;
        }
    }
    if ((ret = avcodec_send_frame(e.enc, NULL)) < 0 || (ret = drain(&e)) != AVERROR_EOF) {
        st = av_fail(diag, ret < 0 ? ret : AVERROR_BUG, "flushing the encoder failed");
        goto cleanup;
    }
    if ((ret = av_write_trailer(e.oc)) < 0) {
        st = av_fail(diag, ret, "cannot finish the mp4 file");
        goto cleanup;
    }
    if (e.pb->error < 0) {
        st = av_fail(diag, e.pb->error, "writing the mp4 file failed");
        goto cleanup;
    }
    *out = e.out.data;
    *out_len = e.out.len;
    e.out.data = NULL;
cleanup:
    close_enc(&e);
    return st;
}

#else /* !DIT_HAVE_MP4 */

/* Built with -Dmp4=disabled (the GPU check bundle, which cannot carry
 * FFmpeg's hundred libraries): the conversion above stays, the encoder
 * says it is absent. */
dit_status dit_mp4_encode(const float *frames, int n_frames, int height, int width, int fps,
                          uint8_t **out, size_t *out_len, dit_diag *diag)
{
    (void)frames;
    (void)out;
    (void)out_len;
    return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                        "this build has no MP4 encoder (built with -Dmp4=disabled) for the %d "
                        "frames of %d x %d at %d fps: ask for the raw tensor instead",
                        n_frames, height, width, fps);
}

#endif /* DIT_HAVE_MP4 */

dit_status dit_mp4_write_file(const char *path, const float *frames, int n_frames, int height,
                              int width, int fps, dit_diag *diag)
{
    if (!path)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "mp4: no output path");
    uint8_t *mp4 = NULL;
    size_t len = 0;
    dit_status st = dit_mp4_encode(frames, n_frames, height, width, fps, &mp4, &len, diag);
    if (st == DIT_OK)
        st = dit_png_write_file(path, mp4, len, diag); /* an atomic write of any bytes */
    free(mp4);
    return st;
}
