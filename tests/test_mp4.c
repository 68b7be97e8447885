/* H.264 MP4 output of generated video (worker/media/mp4.c).
 *
 * quantize: the export quantisation ((x / 2 + 0.5).clamp(0, 1), then
 *           (frame * 255).astype(np.uint8), truncating, in float32) at the
 *           exact float edges between neighbouring bytes; the table was
 *           computed with IEEE float32 arithmetic emulated in Python
 *           (struct.pack('<f', ...) after every operation), independently
 *           of the C code. NaN -> 0, out of range clamps.
 * encode:   synthetic clips (gradients and a moving square) are encoded,
 *           then decoded back here with libavformat/libavcodec: an mp4
 *           (ftyp isom with avc1 and mp41, moov before mdat), one H.264
 *           yuv420p stream of the right size, rate and frame count, its
 *           planes within YUV_MIN_DB of what the encoder was given and its
 *           pixels within RGB_MIN_DB of the quantised input.
 * refuse:   every argument out of range is refused with a message. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/mem.h>
#include <libswscale/swscale.h>

#include "media/mp4.h"

/* PSNR bounds, over a frame's bytes. yuv420p: the decoded planes against
 * the planes the encoder was given (the codec's loss alone): the clips
 * below measure 45.2 dB at worst (CRF 18), a frame against its neighbour
 * 26.1 dB at best. RGB: the decoded frame, converted back with BT.601,
 * against the quantised input (the codec plus the chroma halving of
 * yuv420p; that halving alone, without the codec, measures 37.5 dB for
 * the 32 x 48 clip, on the square's edges): 35.9 dB at worst, a neighbour
 * 23.1 dB at best. Both bounds sit between, 2.9 and 5.2 dB under the
 * worst passing frame. */
#define YUV_MIN_DB 40.0
#define RGB_MIN_DB 33.0

/* Bytes after a packed RGB buffer given to libswscale, whose SIMD code
 * loads 16 bytes at a time past the last row's end (FFmpeg's input padding). */
#define SWS_PAD 64

/* ------------------------------------------------------------------------ */
/* The quantisation                                                          */

typedef struct q_case {
    float x;
    uint8_t want;
} q_case;

/* Pairs (largest x giving k - 1, smallest x giving k) for k = 1, 2, 64,
 * 127, 128, 129, 191, 200, 254, 255, then plain values. */
static const q_case q_table[] = {
    {-0x1.fbfbfcp-1f, 0},
    {-0x1.fbfbfap-1f, 1},
    {-0x1.f7f7f8p-1f, 1},
    {-0x1.f7f7f6p-1f, 2},
    {-0x1.fdfdfep-2f, 63},
    {-0x1.fdfdfcp-2f, 64},
    {-0x1.01018p-8f, 126},
    {-0x1.01017ep-8f, 127},
    {0x1.0101p-8f, 127},
    {0x1.010102p-8f, 128},
    {0x1.81817ep-7f, 128},
    {0x1.81818p-7f, 129},
    {0x1.fdfdfap-2f, 190},
    {0x1.fdfdfcp-2f, 191},
    {0x1.232322p-1f, 199},
    {0x1.232324p-1f, 200},
    {0x1.fbfbfap-1f, 253},
    {0x1.fbfbfcp-1f, 254},
    {0x1.fffffcp-1f, 254},
    {0x1.fffffep-1f, 255},
    /* -1, 1, 0 (127.5 truncates to 127), 0.5, -0.5, 1/3, 0.99 */
    {-0x1p+0f, 0},
    {0x1p+0f, 255},
    {0x0p+0f, 127},
    {0x1p-1f, 191},
    {-0x1p-1f, 63},
    {0x1.555556p-2f, 170},
    {0x1.fae148p-1f, 253},
};

START_TEST(quantize_matches_numpy_at_the_edges)
{
    for (size_t i = 0; i < sizeof q_table / sizeof q_table[0]; i++)
        ck_assert_msg(dit_mp4_quantize(q_table[i].x) == q_table[i].want,
                      "quantize(%a) = %u, want %u", (double)q_table[i].x,
                      dit_mp4_quantize(q_table[i].x), q_table[i].want);
    /* Truncation, not rounding: 2k/255 - 1 lands just under k for some k. */
    ck_assert_uint_eq(dit_mp4_quantize(2.0f / 255.0f - 1.0f), 0);
    ck_assert_uint_eq(dit_mp4_quantize(-0.0f), 127);
    ck_assert_uint_eq(dit_mp4_quantize(NAN), 0);
    ck_assert_uint_eq(dit_mp4_quantize(-NAN), 0);
    ck_assert_uint_eq(dit_mp4_quantize(INFINITY), 255);
    ck_assert_uint_eq(dit_mp4_quantize(-INFINITY), 0);
    ck_assert_uint_eq(dit_mp4_quantize(1.5f), 255);
    ck_assert_uint_eq(dit_mp4_quantize(-1.5f), 0);
    ck_assert_uint_eq(dit_mp4_quantize(3.4e38f), 255);
    ck_assert_uint_eq(dit_mp4_quantize(-3.4e38f), 0);
    ck_assert_uint_eq(dit_mp4_quantize(1e-45f), 127);
}
END_TEST

START_TEST(quantize_is_monotonic_and_reaches_every_byte)
{
    int seen[256] = {0};
    int prev = -1;
    const int n = 1 << 21;
    for (int i = 0; i <= n; i++) {
        float x = -1.01f + 2.02f * (float)i / (float)n;
        int q = dit_mp4_quantize(x);
        ck_assert_msg(q >= prev, "quantize(%a) = %d after %d", (double)x, q, prev);
        prev = q;
        seen[q] = 1;
    }
    for (int k = 0; k < 256; k++)
        ck_assert_msg(seen[k], "byte %d never produced", k);
}
END_TEST

START_TEST(to_rgb8_interleaves_planes)
{
    /* (3, 2, 3): R = -1, G = 0, B = 1 except one marked pixel per plane. */
    float chw[18];
    for (int i = 0; i < 6; i++) {
        chw[i] = -1.0f;
        chw[6 + i] = 0.0f;
        chw[12 + i] = 1.0f;
    }
    chw[4] = 1.0f;      /* R at (1, 1) */
    chw[6 + 2] = -1.0f; /* G at (0, 2) */
    chw[12 + 3] = NAN;  /* B at (1, 0) */
    uint8_t rgb[18];
    dit_mp4_to_rgb8(chw, 6, 2, 3, rgb);
    for (int p = 0; p < 6; p++) {
        ck_assert_uint_eq(rgb[3 * p + 0], p == 4 ? 255 : 0);
        ck_assert_uint_eq(rgb[3 * p + 1], p == 2 ? 0 : 127);
        ck_assert_uint_eq(rgb[3 * p + 2], p == 3 ? 0 : 255);
    }
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Synthetic clips                                                           */

/* (3, F, H, W), as the VAE decodes video: smooth colour gradients that drift with time, and a light
 * grey 8 x 8 square moving 3 pixels right and 2 down per frame. */
static float *make_clip(int F, int H, int W)
{
    const size_t plane = (size_t)H * W;
    float *v = malloc((size_t)F * 3 * plane * sizeof *v);
    ck_assert_ptr_nonnull(v);
    for (int f = 0; f < F; f++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                float *px = v + (size_t)f * plane + (size_t)y * W + x;
                const size_t cs = (size_t)F * plane; /* one channel's frames */
                const int sx = (3 * f) % (W - 8), sy = (2 * f) % (H - 8);
                const int in_sq = x >= sx && x < sx + 8 && y >= sy && y < sy + 8;
                px[0] = in_sq ? 0.8f : -0.8f + 1.6f * (float)x / (float)(W - 1);
                px[cs] = in_sq ? 0.8f : -0.6f + 1.2f * (float)y / (float)(H - 1);
                px[2 * cs] = in_sq ? 0.8f : 0.5f * sinf(0.3f * (float)f + 0.1f * (float)x);
            }
    return v;
}

/* The quantised input, (F, H, W, 3). */
static uint8_t *expected_rgb(const float *clip, int F, int H, int W)
{
    const size_t n = (size_t)H * W * 3;
    uint8_t *rgb = calloc(1, (size_t)F * n + SWS_PAD); /* libswscale reads past the end */
    ck_assert_ptr_nonnull(rgb);
    const size_t plane = (size_t)H * W;
    for (int f = 0; f < F; f++)
        dit_mp4_to_rgb8(clip + (size_t)f * plane, (int64_t)((size_t)F * plane), H, W,
                        rgb + (size_t)f * n);
    return rgb;
}

static void pack_yuv(const uint8_t *const data[3], const int linesize[3], int H, int W,
                     uint8_t *out);

/* What the encoder is given: rgb (F, H, W, 3) as yuv420p planes (packed as
 * pack_yuv does), converted exactly as mp4.c converts them. */
static uint8_t *expected_yuv(const uint8_t *rgb, int F, int H, int W)
{
    const size_t n = (size_t)H * W * 3 / 2;
    uint8_t *out = malloc((size_t)F * n);
    AVFrame *fr = av_frame_alloc();
    ck_assert_ptr_nonnull(out);
    ck_assert_ptr_nonnull(fr);
    fr->format = AV_PIX_FMT_YUV420P;
    fr->width = W;
    fr->height = H;
    ck_assert_int_eq(av_frame_get_buffer(fr, 0), 0);
    struct SwsContext *sws = sws_getContext(W, H, AV_PIX_FMT_RGB24, W, H, AV_PIX_FMT_YUV420P,
                                            SWS_BICUBIC, NULL, NULL, NULL);
    ck_assert_ptr_nonnull(sws);
    const int *bt601 = sws_getCoefficients(SWS_CS_ITU601);
    ck_assert_int_ge(sws_setColorspaceDetails(sws, bt601, 1, bt601, 0, 0, 1 << 16, 1 << 16), 0);
    for (int f = 0; f < F; f++) {
        const uint8_t *src[4] = {rgb + (size_t)f * H * W * 3, NULL, NULL, NULL};
        const int stride[4] = {3 * W, 0, 0, 0};
        sws_scale(sws, src, stride, 0, H, fr->data, fr->linesize);
        pack_yuv((const uint8_t *const *)fr->data, fr->linesize, H, W, out + (size_t)f * n);
    }
    sws_freeContext(sws);
    av_frame_free(&fr);
    return out;
}

/* ------------------------------------------------------------------------ */
/* Decoding the bytes back                                                   */

typedef struct mem_in {
    const uint8_t *data;
    size_t len, pos;
} mem_in;

static int mem_read(void *opaque, uint8_t *buf, int n)
{
    mem_in *m = opaque;
    if (m->pos >= m->len)
        return AVERROR_EOF;
    size_t k = m->len - m->pos < (size_t)n ? m->len - m->pos : (size_t)n;
    memcpy(buf, m->data + m->pos, k);
    m->pos += k;
    return (int)k;
}

static int64_t mem_seek(void *opaque, int64_t off, int whence)
{
    mem_in *m = opaque;
    whence &= ~AVSEEK_FORCE;
    if (whence == AVSEEK_SIZE)
        return (int64_t)m->len;
    int64_t base =
        whence == SEEK_CUR ? (int64_t)m->pos : (whence == SEEK_END ? (int64_t)m->len : 0);
    if (base + off < 0)
        return AVERROR(EINVAL);
    m->pos = (size_t)(base + off);
    return (int64_t)m->pos;
}

typedef struct decoded {
    char demuxer[64];
    enum AVCodecID codec;
    int pix_fmt, width, height, color_space;
    AVRational avg_rate, r_rate;
    int64_t stream_frames; /* what the container says */
    int frames;            /* what the decoder produced */
    uint8_t *rgb;          /* (frames, H, W, 3), BT.601 limited -> full RGB */
    uint8_t *yuv;          /* (frames, H * W * 3 / 2): the Y, U and V planes */
} decoded;

/* One yuv420p picture's planes, packed: Y (H x W), U, V (H/2 x W/2). */
static void pack_yuv(const uint8_t *const data[3], const int linesize[3], int H, int W,
                     uint8_t *out)
{
    for (int y = 0; y < H; y++)
        memcpy(out + (size_t)y * W, data[0] + (size_t)y * linesize[0], (size_t)W);
    uint8_t *u = out + (size_t)H * W, *v = u + (size_t)(H / 2) * (W / 2);
    for (int y = 0; y < H / 2; y++) {
        memcpy(u + (size_t)y * (W / 2), data[1] + (size_t)y * linesize[1], (size_t)W / 2);
        memcpy(v + (size_t)y * (W / 2), data[2] + (size_t)y * linesize[2], (size_t)W / 2);
    }
}

/* Converts one decoded picture to RGB24 into d->rgb (grown per frame). */
static void append_rgb(decoded *d, const AVFrame *fr)
{
    const size_t n = (size_t)fr->width * fr->height * 3;
    d->rgb = realloc(d->rgb, (size_t)(d->frames + 1) * n + SWS_PAD);
    d->yuv = realloc(d->yuv, (size_t)(d->frames + 1) * (n / 2));
    ck_assert_ptr_nonnull(d->rgb);
    ck_assert_ptr_nonnull(d->yuv);
    pack_yuv((const uint8_t *const *)fr->data, fr->linesize, fr->height, fr->width,
             d->yuv + (size_t)d->frames * (n / 2));
    struct SwsContext *sws =
        sws_getContext(fr->width, fr->height, fr->format, fr->width, fr->height, AV_PIX_FMT_RGB24,
                       SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT, NULL, NULL, NULL);
    ck_assert_ptr_nonnull(sws);
    const int *bt601 = sws_getCoefficients(SWS_CS_ITU601);
    ck_assert_int_ge(sws_setColorspaceDetails(sws, bt601, 0, bt601, 1, 0, 1 << 16, 1 << 16), 0);
    uint8_t *dst[4] = {d->rgb + (size_t)d->frames * n, NULL, NULL, NULL}; /* sws_scale reads 4 */
    int stride[4] = {fr->width * 3, 0, 0, 0};
    sws_scale(sws, (const uint8_t *const *)fr->data, fr->linesize, 0, fr->height, dst, stride);
    sws_freeContext(sws);
    d->frames++;
}

static void receive_all(AVCodecContext *dec, AVFrame *fr, decoded *d)
{
    int ret;
    while ((ret = avcodec_receive_frame(dec, fr)) >= 0) {
        ck_assert_int_eq(fr->width, d->width);
        ck_assert_int_eq(fr->height, d->height);
        ck_assert_int_eq(fr->format, AV_PIX_FMT_YUV420P);
        append_rgb(d, fr);
        av_frame_unref(fr);
    }
    ck_assert_msg(ret == AVERROR(EAGAIN) || ret == AVERROR_EOF, "decoding: %s", av_err2str(ret));
}

static decoded decode_mp4(const uint8_t *data, size_t len)
{
    decoded d;
    memset(&d, 0, sizeof d);
    mem_in in = {data, len, 0};
    AVFormatContext *fc = avformat_alloc_context();
    uint8_t *iobuf = av_malloc(4096);
    AVIOContext *pb = avio_alloc_context(iobuf, 4096, 0, &in, mem_read, NULL, mem_seek);
    ck_assert_ptr_nonnull(fc);
    ck_assert_ptr_nonnull(pb);
    fc->pb = pb;
    fc->flags |= AVFMT_FLAG_CUSTOM_IO;
    int ret = avformat_open_input(&fc, NULL, NULL, NULL);
    ck_assert_msg(ret == 0, "avformat_open_input: %s", av_err2str(ret));
    ck_assert_int_ge(avformat_find_stream_info(fc, NULL), 0);
    snprintf(d.demuxer, sizeof d.demuxer, "%s", fc->iformat->name);
    ck_assert_int_eq(fc->nb_streams, 1);
    AVStream *st = fc->streams[0];
    const AVCodecParameters *par = st->codecpar;
    ck_assert_int_eq(par->codec_type, AVMEDIA_TYPE_VIDEO);
    d.codec = par->codec_id;
    d.pix_fmt = par->format;
    d.width = par->width;
    d.height = par->height;
    d.color_space = par->color_space;
    d.avg_rate = st->avg_frame_rate;
    d.r_rate = st->r_frame_rate;
    d.stream_frames = st->nb_frames;

    const AVCodec *codec = avcodec_find_decoder(par->codec_id);
    ck_assert_ptr_nonnull(codec);
    AVCodecContext *dec = avcodec_alloc_context3(codec);
    ck_assert_ptr_nonnull(dec);
    ck_assert_int_ge(avcodec_parameters_to_context(dec, par), 0);
    ck_assert_int_eq(avcodec_open2(dec, codec, NULL), 0);
    AVPacket *pkt = av_packet_alloc();
    AVFrame *fr = av_frame_alloc();
    ck_assert_ptr_nonnull(pkt);
    ck_assert_ptr_nonnull(fr);
    while ((ret = av_read_frame(fc, pkt)) >= 0) {
        ck_assert_int_eq(avcodec_send_packet(dec, pkt), 0);
        av_packet_unref(pkt);
        receive_all(dec, fr, &d);
    }
    ck_assert_msg(ret == AVERROR_EOF, "av_read_frame: %s", av_err2str(ret));
    ck_assert_int_eq(avcodec_send_packet(dec, NULL), 0);
    receive_all(dec, fr, &d);
    av_frame_free(&fr);
    av_packet_free(&pkt);
    avcodec_free_context(&dec);
    avformat_close_input(&fc);
    av_freep(&pb->buffer);
    avio_context_free(&pb);
    return d;
}

static double psnr(const uint8_t *a, const uint8_t *b, size_t n)
{
    double se = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        se += d * d;
    }
    return se == 0 ? INFINITY : 10.0 * log10(255.0 * 255.0 / (se / (double)n));
}

/* Top-level MP4 boxes in order ("ftyp", "moov", ...), as 4-char codes
 * joined by spaces into out; also checks each box fits in the file. */
static void top_level_boxes(const uint8_t *p, size_t len, char *out, size_t cap)
{
    out[0] = '\0';
    size_t pos = 0;
    while (pos + 8 <= len) {
        uint64_t size = (uint64_t)p[pos] << 24 | (uint64_t)p[pos + 1] << 16 |
                        (uint64_t)p[pos + 2] << 8 | p[pos + 3];
        if (size == 1) { /* 64-bit size after the type */
            ck_assert_uint_ge(len - pos, 16);
            size = 0;
            for (int i = 0; i < 8; i++)
                size = size << 8 | p[pos + 8 + i];
        } else if (size == 0) {
            size = len - pos;
        }
        ck_assert_uint_ge(size, 8);
        ck_assert_uint_le(size, len - pos);
        char box[6];
        memcpy(box, p + pos + 4, 4);
        box[4] = ' ';
        box[5] = '\0';
        ck_assert_uint_lt(strlen(out) + 5, cap);
        strcat(out, box);
        pos += size;
    }
    ck_assert_uint_eq(pos, len);
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                  */

typedef struct clip_case {
    int frames, height, width, fps;
} clip_case;

static const clip_case clips[] = {
    {9, 32, 48, 16},
    {1, 32, 48, 24},
    {17, 64, 96, 30},
    {4, 2, 2, 1},
};

START_TEST(encode_decodes_back)
{
    const clip_case c = clips[_i];
    float *clip = make_clip(c.frames, c.height, c.width);
    uint8_t *want = expected_rgb(clip, c.frames, c.height, c.width);
    uint8_t *mp4 = NULL;
    size_t len = 0;
    dit_diag diag;
    dit_diag_clear(&diag);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    dit_status st = dit_mp4_encode(clip, c.frames, c.height, c.width, c.fps, &mp4, &len, &diag);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ck_assert_msg(st == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_ptr_nonnull(mp4);

    /* An ISO base media file: ftyp (isom, listing avc1 and mp41), then
     * moov before mdat (faststart). */
    char boxes[256];
    top_level_boxes(mp4, len, boxes, sizeof boxes);
    ck_assert_msg(strncmp(boxes, "ftyp ", 5) == 0, "boxes: %s", boxes);
    const char *moov = strstr(boxes, "moov"), *mdat = strstr(boxes, "mdat");
    ck_assert_msg(moov && mdat && moov < mdat, "not faststart: %s", boxes);
    ck_assert_mem_eq(mp4 + 8, "isom", 4);
    const uint32_t ftyp_len = (uint32_t)mp4[0] << 24 | mp4[1] << 16 | mp4[2] << 8 | mp4[3];
    int has_avc1 = 0, has_mp41 = 0;
    for (uint32_t o = 16; o + 4 <= ftyp_len; o += 4) {
        has_avc1 |= memcmp(mp4 + o, "avc1", 4) == 0;
        has_mp41 |= memcmp(mp4 + o, "mp41", 4) == 0;
    }
    ck_assert(has_avc1 && has_mp41);

    decoded d = decode_mp4(mp4, len);
    ck_assert_msg(strstr(d.demuxer, "mp4") != NULL, "demuxer %s", d.demuxer);
    ck_assert_int_eq(d.codec, AV_CODEC_ID_H264);
    ck_assert_int_eq(d.pix_fmt, AV_PIX_FMT_YUV420P);
    ck_assert_int_eq(d.color_space, AVCOL_SPC_SMPTE170M);
    ck_assert_int_eq(d.width, c.width);
    ck_assert_int_eq(d.height, c.height);
    ck_assert_int_eq(d.stream_frames, c.frames);
    ck_assert_int_eq(d.frames, c.frames);
    ck_assert_msg(av_cmp_q(d.avg_rate, (AVRational){c.fps, 1}) == 0, "avg_frame_rate %d/%d",
                  d.avg_rate.num, d.avg_rate.den);
    ck_assert_msg(av_cmp_q(d.r_rate, (AVRational){c.fps, 1}) == 0, "r_frame_rate %d/%d",
                  d.r_rate.num, d.r_rate.den);

    /* The codec alone: decoded planes against what the encoder was given. */
    const size_t fsz = (size_t)c.height * c.width * 3, ysz = fsz / 2;
    uint8_t *want_yuv = expected_yuv(want, c.frames, c.height, c.width);
    double yuv_worst = INFINITY, rgb_worst = INFINITY;
    for (int f = 0; f < c.frames; f++) {
        const double py = psnr(d.yuv + (size_t)f * ysz, want_yuv + (size_t)f * ysz, ysz);
        const double pr = psnr(d.rgb + (size_t)f * fsz, want + (size_t)f * fsz, fsz);
        yuv_worst = py < yuv_worst ? py : yuv_worst;
        rgb_worst = pr < rgb_worst ? pr : rgb_worst;
        ck_assert_msg(py > YUV_MIN_DB, "frame %d: yuv420p PSNR %.2f dB", f, py);
        /* A 2 x 2 frame has one chroma sample for a whole colour gradient. */
        if (c.height >= 32)
            ck_assert_msg(pr > RGB_MIN_DB, "frame %d: RGB PSNR %.2f dB", f, pr);
    }
    /* The bounds can fail: frame 0 against the input's frame 1 (the square
     * has moved, the colours drifted). */
    double shifted_yuv = INFINITY, shifted_rgb = INFINITY;
    if (c.frames > 1 && c.height >= 32) {
        shifted_yuv = psnr(d.yuv, want_yuv + ysz, ysz);
        shifted_rgb = psnr(d.rgb, want + fsz, fsz);
        ck_assert_msg(shifted_yuv < YUV_MIN_DB, "a neighbouring frame: %.2f dB", shifted_yuv);
        ck_assert_msg(shifted_rgb < RGB_MIN_DB, "a neighbouring frame: %.2f dB", shifted_rgb);
    }
    printf("mp4 %d x %d x %d @ %d fps: %zu bytes, %.1f ms; worst frame PSNR: yuv420p %.2f dB, "
           "RGB %.2f dB (neighbouring frame: %.2f, %.2f)\n",
           c.frames, c.height, c.width, c.fps, len,
           (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6,
           yuv_worst, rgb_worst, shifted_yuv, shifted_rgb);
    free(want_yuv);
    free(d.yuv);
    free(d.rgb);
    free(mp4);
    free(want);
    free(clip);
}
END_TEST

/* dit_mp4_write_file writes an MP4 of the clip. Its bytes are not compared
 * with dit_mp4_encode's: libx264's AVX-512 code makes the bitstream depend
 * on the contents of memory it has not written (measured with glibc's
 * MALLOC_PERTURB_: the same input gives 47076, 47286 or 47045 bytes for 20
 * frames of 480 x 832; identical bytes with its asm capped at AVX2), so
 * two encodes of one clip agree in their pictures, not in their bytes. */
START_TEST(write_file_writes_the_clip)
{
    const int F = 5, H = 32, W = 48, fps = 16;
    float *clip = make_clip(F, H, W);
    uint8_t *want = expected_rgb(clip, F, H, W);
    dit_diag diag;
    dit_diag_clear(&diag);
    char dir[] = "/tmp/dit-mp4-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof path, "%s/clip.mp4", dir);
    ck_assert_msg(dit_mp4_write_file(path, clip, F, H, W, fps, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    FILE *fp = fopen(path, "rb");
    ck_assert_ptr_nonnull(fp);
    size_t cap = 1 << 20;
    uint8_t *bytes = malloc(cap);
    ck_assert_ptr_nonnull(bytes);
    size_t len = fread(bytes, 1, cap, fp);
    fclose(fp);
    ck_assert_uint_gt(len, 0);
    ck_assert_uint_lt(len, cap);
    decoded d = decode_mp4(bytes, len);
    ck_assert_int_eq(d.codec, AV_CODEC_ID_H264);
    ck_assert_int_eq(d.frames, F);
    ck_assert_int_eq(d.width, W);
    ck_assert_int_eq(d.height, H);
    const size_t fsz = (size_t)H * W * 3;
    for (int f = 0; f < F; f++) {
        const double p = psnr(d.rgb + (size_t)f * fsz, want + (size_t)f * fsz, fsz);
        ck_assert_msg(p > RGB_MIN_DB, "frame %d: RGB PSNR %.2f dB", f, p);
    }
    ck_assert_int_eq(unlink(path), 0);
    /* A folder that does not exist: an error naming the path. */
    char bad[96];
    snprintf(bad, sizeof bad, "%s/missing/clip.mp4", dir);
    dit_diag_clear(&diag);
    ck_assert_int_ne(dit_mp4_write_file(bad, clip, F, H, W, fps, &diag), DIT_OK);
    ck_assert_ptr_nonnull(strstr(dit_diag_msg(&diag), "missing"));
    ck_assert_int_eq(rmdir(dir), 0);
    free(d.rgb);
    free(d.yuv);
    free(bytes);
    free(want);
    free(clip);
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Refusals                                                                  */

/* Expects DIT_ERR_INVALID_ARG with `word` in the message, and the outputs
 * left alone. */
static void expect_refused(const float *frames, int n, int h, int w, int fps, const char *word)
{
    uint8_t sentinel = 0;
    uint8_t *out = &sentinel;
    size_t len = 12345;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_mp4_encode(frames, n, h, w, fps, &out, &len, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(dit_diag_msg(&diag), word) != NULL, "%d frames %d x %d @ %d: '%s'", n, h,
                  w, fps, dit_diag_msg(&diag));
    ck_assert_ptr_eq(out, &sentinel);
    ck_assert_uint_eq(len, 12345);
}

START_TEST(bad_arguments_are_refused)
{
    float *clip = make_clip(1, 32, 48);
    expect_refused(clip, 1, 32, 47, 16, "even");
    expect_refused(clip, 1, 31, 48, 16, "even");
    expect_refused(clip, 1, 3, 3, 16, "even");
    expect_refused(clip, 0, 32, 48, 16, "0 frames");
    expect_refused(clip, -1, 32, 48, 16, "-1 frames");
    expect_refused(clip, DIT_MP4_MAX_FRAMES + 1, 32, 48, 16, "10001 frames");
    expect_refused(clip, 1, 32, 48, 0, "fps 0");
    expect_refused(clip, 1, 32, 48, -5, "fps -5");
    expect_refused(clip, 1, 32, 48, DIT_MP4_MAX_FPS + 1, "fps 241");
    expect_refused(clip, 1, 0, 48, 16, "2 to 8192");
    expect_refused(clip, 1, 32, -2, 16, "2 to 8192");
    expect_refused(clip, 1, 32, DIT_MP4_MAX_SIDE + 2, 16, "2 to 8192");
    expect_refused(clip, 1, 32, 2147483646, 16, "2 to 8192");
    expect_refused(NULL, 1, 32, 48, 16, "frames is NULL");
    uint8_t *out = NULL;
    size_t len = 0;
    ck_assert_int_eq(dit_mp4_encode(clip, 1, 32, 48, 16, NULL, &len, NULL), DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(dit_mp4_encode(clip, 1, 32, 48, 16, &out, NULL, NULL), DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(dit_mp4_write_file(NULL, clip, 1, 32, 48, 16, NULL), DIT_ERR_INVALID_ARG);
    free(clip);
}
END_TEST

/* Values outside [-1, 1], NaN and infinities encode (as 0/255 and 0). */
START_TEST(non_finite_input_encodes)
{
    const int F = 2, H = 16, W = 16;
    float *v = malloc((size_t)F * 3 * H * W * sizeof *v);
    for (int i = 0; i < F * 3 * H * W; i++)
        v[i] = i % 4 == 0 ? NAN : (i % 4 == 1 ? INFINITY : (i % 4 == 2 ? -1e30f : 5.0f));
    uint8_t *mp4 = NULL;
    size_t len = 0;
    dit_diag diag;
    ck_assert_msg(dit_mp4_encode(v, F, H, W, 8, &mp4, &len, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    decoded d = decode_mp4(mp4, len);
    ck_assert_int_eq(d.frames, F);
    free(d.rgb);
    free(d.yuv);
    free(mp4);
    free(v);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("mp4");

    TCase *q = tcase_create("quantize");
    tcase_add_test(q, quantize_matches_numpy_at_the_edges);
    tcase_add_test(q, quantize_is_monotonic_and_reaches_every_byte);
    tcase_add_test(q, to_rgb8_interleaves_planes);
    suite_add_tcase(s, q);

    TCase *enc = tcase_create("encode");
    tcase_add_loop_test(enc, encode_decodes_back, 0, (int)(sizeof clips / sizeof clips[0]));
    tcase_add_test(enc, write_file_writes_the_clip);
    tcase_add_test(enc, non_finite_input_encodes);
    suite_add_tcase(s, enc);

    TCase *bad = tcase_create("refuse");
    tcase_add_test(bad, bad_arguments_are_refused);
    suite_add_tcase(s, bad);

    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
