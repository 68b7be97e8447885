/* Unit tests for the safetensors loader and writer.
 *
 * Malformed files are built byte by byte (length prefix, header text, data)
 * so that each test breaks exactly one rule; every failure must come back
 * with the right status and a message naming the file and the tensor. Each
 * TCase makes one mkdtemp directory (each test a subdirectory of it) and
 * removes it afterwards. */
#include <check.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loader/safetensors.h"

/* ---- temp directory ------------------------------------------------------ */

/* Set by the unchecked fixture in the parent, inherited by forked tests. */
static char tmp_root[PATH_MAX];

static void tmp_setup(void)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/dit_st_test.XXXXXX");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        abort();
    }
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void tmp_teardown(void)
{
    if (tmp_root[0])
        nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    tmp_root[0] = '\0';
}

/* Formats a path into a PATH_MAX buffer, failing the test if it does not fit. */
__attribute__((format(printf, 2, 3))) static void fmt_path(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, PATH_MAX, fmt, ap);
    va_end(ap);
    ck_assert_msg(n >= 0 && n < PATH_MAX, "path too long");
}

/* A fresh directory per test, so tests never see each other's files. */
static void test_dir(char *out, const char *test)
{
    fmt_path(out, "%s/%s", tmp_root, test);
    ck_assert_msg(mkdir(out, 0755) == 0, "mkdir %s failed", out);
}

static void join(char *out, const char *dir, const char *name)
{
    fmt_path(out, "%s/%s", dir, name);
}

#define TEST_DIR(var)                                                                              \
    char var[PATH_MAX];                                                                            \
    test_dir(var, __func__)

/* ---- building files -------------------------------------------------------- */

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *fp = fopen(path, "wb");
    ck_assert_msg(fp != NULL, "cannot create %s", path);
    if (n)
        ck_assert_uint_eq(fwrite(data, 1, n, fp), n);
    ck_assert_int_eq(fclose(fp), 0);
}

/* Length prefix `hlen` (which may lie), then `header` as text, then data. */
static void write_st_raw(const char *path, uint64_t hlen, const char *header, const void *data,
                         size_t dlen)
{
    size_t htext = strlen(header);
    size_t n = 8 + htext + dlen;
    unsigned char *buf = calloc(1, n ? n : 1);
    ck_assert_ptr_nonnull(buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(buf + 8, header, htext);
    if (dlen)
        memcpy(buf + 8 + htext, data, dlen);
    write_bytes(path, buf, n);
    free(buf);
}

static void write_st(const char *path, const char *header, const void *data, size_t dlen)
{
    write_st_raw(path, strlen(header), header, data, dlen);
}

/* A header + `dlen` zero bytes of data. */
static void write_st_zeros(const char *path, const char *header, size_t dlen)
{
    void *z = calloc(1, dlen ? dlen : 1);
    ck_assert_ptr_nonnull(z);
    write_st(path, header, z, dlen);
    free(z);
}

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* Opening `path` must fail with `want`; the message must name the file and
 * contain every further (NULL-terminated) needle. */
static void expect_open_fail(const char *path, dit_status want, ...)
{
    dit_diag d;
    dit_diag_clear(&d);
    dit_st_file *f = NULL;
    dit_status st = dit_st_file_open(path, &f, &d);
    ck_assert_msg(st == want, "%s: got %s, want %s (%s)", path, dit_status_name(st),
                  dit_status_name(want), dit_diag_msg(&d));
    ck_assert_ptr_null(f);
    ck_assert_int_eq(d.status, want);
    ck_assert_msg(strstr(d.msg, base_name(path)) != NULL, "message '%s' does not name %s", d.msg,
                  base_name(path));
    va_list ap;
    va_start(ap, want);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        ck_assert_msg(strstr(d.msg, needle) != NULL, "message '%s' lacks '%s'", d.msg, needle);
    va_end(ap);
}

/* The same for a set opened by path. */
static void expect_set_fail(const char *path, dit_status want, ...)
{
    dit_diag d;
    dit_diag_clear(&d);
    dit_st_set *s = NULL;
    dit_status st = dit_st_set_open_path(path, &s, &d);
    ck_assert_msg(st == want, "%s: got %s, want %s (%s)", path, dit_status_name(st),
                  dit_status_name(want), dit_diag_msg(&d));
    ck_assert_ptr_null(s);
    va_list ap;
    va_start(ap, want);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        ck_assert_msg(strstr(d.msg, needle) != NULL, "message '%s' lacks '%s'", d.msg, needle);
    va_end(ap);
}

static dit_st_file *open_ok(const char *path)
{
    dit_diag d;
    dit_diag_clear(&d);
    dit_st_file *f = NULL;
    dit_status st = dit_st_file_open(path, &f, &d);
    ck_assert_msg(st == DIT_OK, "%s: %s", path, dit_diag_msg(&d));
    ck_assert_ptr_nonnull(f);
    return f;
}

static void write_ok(const char *path, const dit_st_write_item *items, size_t n)
{
    dit_diag d;
    dit_diag_clear(&d);
    dit_status st = dit_st_write(path, items, n, &d);
    ck_assert_msg(st == DIT_OK, "%s: %s", path, dit_diag_msg(&d));
}

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Tensor names of a file's 1-d F32 tensors, value i*10+j at element j. */
static void write_shard(const char *path, const char *const *names, size_t n)
{
    float vals[8][2];
    dit_tensor ts[8];
    dit_st_write_item items[8];
    ck_assert_uint_le(n, 8);
    for (size_t i = 0; i < n; i++) {
        /* Distinct values per name: the first character identifies it. */
        vals[i][0] = (float)names[i][0];
        vals[i][1] = (float)names[i][0] + 0.5f;
        ts[i] = dit_tensor_1d(vals[i], DIT_F32, 2);
        items[i].name = names[i];
        items[i].tensor = &ts[i];
    }
    write_ok(path, items, n);
}

static void write_index(const char *path, const char *weight_map_body)
{
    char text[4096];
    snprintf(text, sizeof text, "{\"metadata\": {\"total_size\": 32}, \"weight_map\": {%s}}",
             weight_map_body);
    write_bytes(path, text, strlen(text));
}

/* ---- malformed single files ------------------------------------------------ */

START_TEST(test_file_shorter_than_8)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "short.safetensors");
    write_bytes(p, "\x02\x00\x00\x00\x00", 5);
    expect_open_fail(p, DIT_ERR_FORMAT, "5 bytes", NULL);
    join(p, dir, "empty.safetensors");
    write_bytes(p, "", 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "0 bytes", NULL);
}
END_TEST

START_TEST(test_missing_file)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "absent.safetensors");
    expect_open_fail(p, DIT_ERR_NOT_FOUND, "No such file", NULL);
}
END_TEST

START_TEST(test_directory_not_file)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "dir.safetensors");
    ck_assert_int_eq(mkdir(p, 0755), 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "not a regular file", NULL);
}
END_TEST

START_TEST(test_header_length_past_end)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "hlen.safetensors");
    write_st_raw(p, 1000, "{}", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "header length 1000", "past the end", NULL);
    /* A length that would wrap any signed or added arithmetic. */
    join(p, dir, "hlen_huge.safetensors");
    write_st_raw(p, UINT64_MAX, "{}", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "past the end", NULL);
}
END_TEST

START_TEST(test_header_length_absurd)
{
    /* A sparse file large enough that the header length fits in it, but
     * beyond the 100 MB limit: refused before anything is read or copied. */
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "absurd.safetensors");
    uint64_t hlen = ((uint64_t)100 << 20) + 8;
    unsigned char len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (unsigned char)(hlen >> (8 * i));
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, len, 8), 8);
    ck_assert_int_eq(ftruncate(fd, (off_t)(8 + hlen + 64)), 0);
    close(fd);
    expect_open_fail(p, DIT_ERR_FORMAT, "limit", NULL);
}
END_TEST

START_TEST(test_truncated_data)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "trunc.safetensors");
    write_st_zeros(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[0,48]}}", 40);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'w'", "[0, 48]", "40 bytes", NULL);
}
END_TEST

START_TEST(test_bad_json)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "badjson.safetensors");
    write_st(p, "{\"w\": {\"dtype\": \"F32\", ", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "not valid JSON", NULL);
    join(p, dir, "emptyheader.safetensors");
    write_st(p, "", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "not valid JSON", NULL);
}
END_TEST

START_TEST(test_trailing_garbage)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "trailing.safetensors");
    write_st(p, "{} x", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "trailing", NULL);
}
END_TEST

START_TEST(test_header_not_object)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "array.safetensors");
    write_st(p, "[1, 2, 3]", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "not a JSON object", NULL);
    join(p, dir, "string.safetensors");
    write_st(p, "\"hello\"", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "not a JSON object", NULL);
}
END_TEST

START_TEST(test_entry_not_object)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "entry.safetensors");
    write_st(p, "{\"blocks.0.w\": [1, 2]}", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'blocks.0.w'", "not a JSON object", NULL);
}
END_TEST

START_TEST(test_unknown_dtype)
{
    static const char *const bad[] = {"I64", "F64", "U8", "BOOL", "f32", "F8_E5M2", "f8_e4m3", ""};
    TEST_DIR(dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char p[PATH_MAX], name[64], header[256], want[128];
        snprintf(name, sizeof name, "dtype%zu.safetensors", i);
        join(p, dir, name);
        snprintf(header, sizeof header,
                 "{\"x\":{\"dtype\":\"%s\",\"shape\":[1],\"data_offsets\":[0,8]}}", bad[i]);
        write_st_zeros(p, header, 8);
        snprintf(want, sizeof want,
                 "tensor 'x': dtype '%s' is not supported (supported: F32, BF16, F16, F8_E4M3)",
                 bad[i]);
        expect_open_fail(p, DIT_ERR_UNSUPPORTED, want, NULL);
    }
}
END_TEST

START_TEST(test_missing_dtype)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "nodtype.safetensors");
    write_st_zeros(p, "{\"x\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "missing \"dtype\"", NULL);
}
END_TEST

START_TEST(test_dtype_not_string)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "dtypenum.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "\"dtype\" is not a string", NULL);
}
END_TEST

START_TEST(test_missing_shape)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "noshape.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "missing \"shape\"", NULL);
}
END_TEST

START_TEST(test_shape_not_array)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "shapeobj.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", 16);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "\"shape\" is not an array", NULL);
}
END_TEST

START_TEST(test_missing_offsets)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "nooffsets.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "missing \"data_offsets\"", NULL);
}
END_TEST

START_TEST(test_offsets_ill_typed)
{
    static const char *const bad[] = {"[0]",      "[0, 4, 8]", "[-1, 3]", "[\"0\", 4]",
                                      "[0, 4.5]", "{}",        "4",       "[0, 9007199254740993]"};
    TEST_DIR(dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char p[PATH_MAX], name[64], header[256];
        snprintf(name, sizeof name, "offs%zu.safetensors", i);
        join(p, dir, name);
        snprintf(header, sizeof header,
                 "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":%s}}", bad[i]);
        write_st_zeros(p, header, 4);
        expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "data_offsets", NULL);
    }
}
END_TEST

START_TEST(test_negative_shape)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "negshape.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2,-2],\"data_offsets\":[0,16]}}", 16);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "shape[1]", NULL);
}
END_TEST

START_TEST(test_non_integer_shape)
{
    static const char *const bad[] = {"[2.5]", "[\"2\"]", "[null]", "[[2]]", "[1e300]"};
    TEST_DIR(dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char p[PATH_MAX], name[64], header[256];
        snprintf(name, sizeof name, "shape%zu.safetensors", i);
        join(p, dir, name);
        snprintf(header, sizeof header,
                 "{\"x\":{\"dtype\":\"F32\",\"shape\":%s,\"data_offsets\":[0,8]}}", bad[i]);
        write_st_zeros(p, header, 8);
        expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "shape[0]", NULL);
    }
}
END_TEST

START_TEST(test_too_many_dims)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "dims.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,2],\"data_offsets\":[0,8]}}",
                   8);
    expect_open_fail(p, DIT_ERR_UNSUPPORTED, "tensor 'x'", "6 dims", "at most 5", NULL);
}
END_TEST

START_TEST(test_offsets_begin_after_end)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "order.safetensors");
    write_st_zeros(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 8);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "[8, 4]", "begin after end", NULL);
}
END_TEST

START_TEST(test_offsets_past_end)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "past.safetensors");
    write_st_zeros(p,
                   "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                   16);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'b'", "[12, 20]", "past the end", NULL);
}
END_TEST

START_TEST(test_overlapping_tensors)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "overlap.safetensors");
    write_st_zeros(p,
                   "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                   "\"c\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]},"
                   "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                   24);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'b'", "overlaps tensor 'a'", NULL);
    /* Contained entirely in a bigger one, sorted after a small neighbour. */
    join(p, dir, "contained.safetensors");
    write_st_zeros(p,
                   "{\"big\":{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[0,32]},"
                   "\"s1\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                   32);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 's1'", "overlaps tensor 'big'", NULL);
}
END_TEST

START_TEST(test_size_mismatch)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "model.safetensors");
    write_st_zeros(
        p, "{\"proj_out.weight\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[0,100]}}",
        100);
    expect_open_fail(p, DIT_ERR_FORMAT,
                     "model.safetensors: tensor 'proj_out.weight': data_offsets [0, 100] but "
                     "shape (3, 4) F32 needs 48 bytes",
                     NULL);
    join(p, dir, "bf16.safetensors");
    write_st_zeros(p, "{\"n\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,12]}}", 12);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'n'", "(3) BF16 needs 6 bytes", NULL);
}
END_TEST

START_TEST(test_shape_overflow)
{
    /* 2^52 * 2^52 * 16 wraps 64 bits; a check on the product alone could be
     * fooled into matching a small byte range. */
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "overflow.safetensors");
    write_st_zeros(p,
                   "{\"x\":{\"dtype\":\"F32\",\"shape\":[4503599627370496,4503599627370496,16],"
                   "\"data_offsets\":[0,0]}}",
                   0);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "too large", NULL);
    /* Zero elements, but strides that would overflow int64. */
    join(p, dir, "overflow0.safetensors");
    write_st_zeros(p,
                   "{\"x\":{\"dtype\":\"F32\",\"shape\":[0,4503599627370496,4503599627370496],"
                   "\"data_offsets\":[0,0]}}",
                   0);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "too large", NULL);
}
END_TEST

START_TEST(test_duplicate_names)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "dup.safetensors");
    write_st_zeros(p,
                   "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                   "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                   "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                   12);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'w'", "twice", NULL);
}
END_TEST

START_TEST(test_bad_metadata)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "meta_arr.safetensors");
    write_st(p, "{\"__metadata__\": [\"pt\"]}", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "__metadata__", "not a JSON object", NULL);
    join(p, dir, "meta_num.safetensors");
    write_st(p, "{\"__metadata__\": {\"format\": \"pt\", \"step\": 5}}", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "__metadata__", "'step'", "not a string", NULL);
    join(p, dir, "meta_twice.safetensors");
    write_st(p, "{\"__metadata__\": {}, \"__metadata__\": {}}", NULL, 0);
    expect_open_fail(p, DIT_ERR_FORMAT, "__metadata__", "twice", NULL);
}
END_TEST

/* Every prefix of a valid file and many single-byte corruptions of its
 * header: each must open or fail cleanly (ASan/valgrind catch the rest). */
START_TEST(test_truncations_and_corruptions)
{
    TEST_DIR(dir);
    char src[PATH_MAX], p[PATH_MAX];
    join(src, dir, "good.safetensors");
    join(p, dir, "bad.safetensors");
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[3] = {0x3f80, 0x4000, 0x4040};
    dit_tensor ta = dit_tensor_2d(a, DIT_F32, 2, 3), tb = dit_tensor_1d(b, DIT_BF16, 3);
    dit_st_write_item items[] = {{"alpha", &ta}, {"beta", &tb}};
    write_ok(src, items, 2);

    FILE *fp = fopen(src, "rb");
    ck_assert_ptr_nonnull(fp);
    unsigned char buf[1024];
    size_t n = fread(buf, 1, sizeof buf, fp);
    fclose(fp);
    ck_assert_uint_gt(n, 8);
    ck_assert_uint_lt(n, sizeof buf);

    for (size_t len = 0; len < n; len++) {
        write_bytes(p, buf, len);
        dit_st_file *f = NULL;
        dit_diag d;
        dit_diag_clear(&d);
        ck_assert_int_ne(dit_st_file_open(p, &f, &d), DIT_OK);
        ck_assert_ptr_null(f);
        ck_assert_ptr_nonnull(strstr(d.msg, "bad.safetensors"));
    }

    uint32_t rng = 12345;
    unsigned char mutated[1024];
    for (int iter = 0; iter < 2000; iter++) {
        memcpy(mutated, buf, n);
        for (int k = 0; k < 1 + iter % 3; k++) {
            rng = rng * 1664525u + 1013904223u;
            size_t pos = (rng >> 8) % n;
            rng = rng * 1664525u + 1013904223u;
            mutated[pos] = (unsigned char)(rng >> 24);
        }
        write_bytes(p, mutated, n);
        dit_st_file *f = NULL;
        dit_diag d;
        dit_diag_clear(&d);
        dit_status st = dit_st_file_open(p, &f, &d);
        if (st == DIT_OK) {
            ck_assert_ptr_nonnull(f);
            /* Every view lies inside the file: read each one whole. */
            for (size_t i = 0; i < dit_st_file_count(f); i++) {
                const dit_st_entry *e = dit_st_file_at(f, i);
                size_t nbytes = dit_tensor_nbytes(&e->view);
                ck_assert_uint_le(nbytes, n);
                unsigned char copy[1024];
                memcpy(copy, e->view.data, nbytes);
            }
            dit_st_file_close(f);
        } else {
            ck_assert_ptr_null(f);
            ck_assert_ptr_nonnull(strstr(d.msg, "bad.safetensors"));
        }
    }
}
END_TEST

/* ---- valid files ------------------------------------------------------------ */

START_TEST(test_roundtrip_dtypes)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "rt.safetensors");
    float f32[2][3] = {{1.5f, -2.25f, 0.0f}, {3.0e38f, 1.0e-40f, -0.0f}};
    f32[1][2] = NAN;
    /* Listed bf16 first: the writer still puts the f32 data first so it is
     * 4-byte aligned in the file. */
    uint16_t bf16[5] = {0x3f80, 0xbfc0, 0x7f80, 0x0001, 0x7fc1};
    uint16_t f16[2][2] = {{0x3c00, 0xc000}, {0x7bff, 0x0001}};
    uint16_t scalar = 0x4248; /* f16 3.140625 */
    dit_tensor tb = dit_tensor_1d(bf16, DIT_BF16, 5);
    dit_tensor tf = dit_tensor_2d(f32, DIT_F32, 2, 3);
    dit_tensor th = dit_tensor_2d(f16, DIT_F16, 2, 2);
    dit_tensor ts = dit_tensor_make(&scalar, DIT_F16, 0, NULL);
    dit_st_write_item items[] = {
        {"b.bf16", &tb}, {"a.f32", &tf}, {"c.f16", &th}, {"d.scalar", &ts}};
    write_ok(p, items, 4);
    /* No temp file left behind. */
    char tmp[PATH_MAX];
    fmt_path(tmp, "%s.tmp.%ld", p, (long)getpid());
    ck_assert(!file_exists(tmp));

    /* The data buffer starts at a multiple of 8. */
    FILE *fp = fopen(p, "rb");
    ck_assert_ptr_nonnull(fp);
    unsigned char len[8];
    ck_assert_uint_eq(fread(len, 1, 8, fp), 8);
    fclose(fp);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | len[i];
    ck_assert_uint_eq((8 + hlen) % 8, 0);

    dit_st_file *f = open_ok(p);
    ck_assert_uint_eq(dit_st_file_count(f), 4);
    ck_assert_str_eq(dit_st_file_at(f, 0)->name, "a.f32");
    ck_assert_str_eq(dit_st_file_at(f, 1)->name, "b.bf16");
    ck_assert_str_eq(dit_st_file_at(f, 2)->name, "c.f16");
    ck_assert_str_eq(dit_st_file_at(f, 3)->name, "d.scalar");
    ck_assert_ptr_null(dit_st_file_at(f, 4));

    const dit_st_entry *e = dit_st_file_find(f, "a.f32");
    ck_assert_ptr_nonnull(e);
    ck_assert_str_eq(e->file, p);
    ck_assert_int_eq(e->view.dtype, DIT_F32);
    ck_assert_int_eq(e->view.ndim, 2);
    ck_assert_int_eq(e->view.ne[0], 2);
    ck_assert_int_eq(e->view.ne[1], 3);
    ck_assert(dit_tensor_is_contiguous(&e->view));
    ck_assert_uint_eq((uintptr_t)e->view.data % 4, 0);
    ck_assert_mem_eq(e->view.data, f32, sizeof f32);

    e = dit_st_file_find(f, "b.bf16");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.dtype, DIT_BF16);
    ck_assert_int_eq(e->view.ndim, 1);
    ck_assert_int_eq(e->view.ne[0], 5);
    ck_assert_mem_eq(e->view.data, bf16, sizeof bf16);

    e = dit_st_file_find(f, "c.f16");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.dtype, DIT_F16);
    ck_assert_int_eq(e->view.ndim, 2);
    ck_assert_int_eq(e->view.nb[0], 4);
    ck_assert_int_eq(e->view.nb[1], 2);
    ck_assert_mem_eq(e->view.data, f16, sizeof f16);

    e = dit_st_file_find(f, "d.scalar");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ndim, 0);
    ck_assert_int_eq(dit_tensor_numel(&e->view), 1);
    ck_assert_mem_eq(e->view.data, &scalar, 2);

    ck_assert_ptr_null(dit_st_file_find(f, "a"));
    ck_assert_ptr_null(dit_st_file_find(f, "zzz"));
    ck_assert_ptr_null(dit_st_file_find(f, ""));
    dit_st_file_close(f);

    /* Writing again replaces the file. */
    dit_st_write_item one[] = {{"only", &tb}};
    write_ok(p, one, 1);
    f = open_ok(p);
    ck_assert_uint_eq(dit_st_file_count(f), 1);
    ck_assert_ptr_nonnull(dit_st_file_find(f, "only"));
    dit_st_file_close(f);
}
END_TEST

START_TEST(test_write_strided)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "strided.safetensors");
    float m[3][4];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++)
            m[i][j] = (float)(10 * i + j);
    dit_tensor full = dit_tensor_2d(m, DIT_F32, 3, 4);
    /* Transpose: (4, 3) with element stride 16 bytes in the inner dim. */
    dit_tensor tr = full;
    tr.ne[0] = 4;
    tr.ne[1] = 3;
    tr.nb[0] = 4;
    tr.nb[1] = 16;
    /* Columns 1..2: dense rows, but not contiguous. */
    dit_tensor cols = dit_tensor_narrow(&full, 1, 1, 2);
    ck_assert(!dit_tensor_is_contiguous(&tr));
    ck_assert(!dit_tensor_is_contiguous(&cols));
    /* bf16 split into 4 dims, every other inner element. */
    uint16_t h[2][3][8];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 8; k++)
                h[i][j][k] = (uint16_t)(100 * i + 10 * j + k);
    dit_tensor hs = dit_tensor_3d(h, DIT_BF16, 2, 3, 8);
    hs.ne[2] = 4; /* elements k = 0, 2, 4, 6: inner stride 4 bytes */
    hs.nb[2] = 4;
    dit_st_write_item items[] = {{"t", &tr}, {"cols", &cols}, {"hs", &hs}};
    write_ok(p, items, 3);

    dit_st_file *f = open_ok(p);
    const dit_st_entry *e = dit_st_file_find(f, "t");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ne[0], 4);
    ck_assert_int_eq(e->view.ne[1], 3);
    float got[12];
    memcpy(got, e->view.data, sizeof got);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            ck_assert_float_eq(got[i * 3 + j], m[j][i]);

    e = dit_st_file_find(f, "cols");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ne[0], 3);
    ck_assert_int_eq(e->view.ne[1], 2);
    float got2[6];
    memcpy(got2, e->view.data, sizeof got2);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 2; j++)
            ck_assert_float_eq(got2[i * 2 + j], m[i][j + 1]);

    e = dit_st_file_find(f, "hs");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ndim, 3);
    uint16_t got3[24];
    memcpy(got3, e->view.data, sizeof got3);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 4; k++)
                ck_assert_uint_eq(got3[(i * 3 + j) * 4 + k], h[i][j][2 * k]);
    dit_st_file_close(f);
}
END_TEST

START_TEST(test_five_dims)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "video.safetensors");
    /* A (1, 2, 3, 2, 4) latent, written from a frame slice of a (1, 2, 5, 2,
     * 4) one: non-contiguous in a middle dim. */
    float big[1][2][5][2][4];
    for (int c = 0; c < 2; c++)
        for (int f = 0; f < 5; f++)
            for (int h = 0; h < 2; h++)
                for (int w = 0; w < 4; w++)
                    big[0][c][f][h][w] = (float)(1000 * c + 100 * f + 10 * h + w);
    dit_tensor t = dit_tensor_5d(big, DIT_F32, 1, 2, 5, 2, 4);
    dit_tensor v = dit_tensor_narrow(&t, 2, 1, 3);
    dit_st_write_item items[] = {{"latents", &v}};
    write_ok(p, items, 1);
    dit_st_file *f = open_ok(p);
    const dit_st_entry *e = dit_st_file_find(f, "latents");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ndim, 5);
    const int64_t want[5] = {1, 2, 3, 2, 4};
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(e->view.ne[i], want[i]);
    ck_assert(dit_tensor_is_contiguous(&e->view));
    float got[48];
    memcpy(got, e->view.data, sizeof got);
    int k = 0;
    for (int c = 0; c < 2; c++)
        for (int fr = 1; fr < 4; fr++)
            for (int h = 0; h < 2; h++)
                for (int w = 0; w < 4; w++)
                    ck_assert_float_eq(got[k++], big[0][c][fr][h][w]);
    dit_st_file_close(f);
}
END_TEST

/* An (N, K) = (4, 64) E4M3 weight holding every bit pattern, with a
 * per-tensor f32 scale, a per-row (N, 1) bf16 one and a few bad ones,
 * written by the project's writer; then read and converted. */
START_TEST(test_f8_e4m3_with_scales)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "fp8.safetensors");
    uint8_t q[4][64];
    for (int i = 0; i < 256; i++)
        q[i / 64][i % 64] = (uint8_t)i;
    float s_tensor = 0.03125f;
    uint16_t s_rows[4][1] = {{0x3f80}, {0x4000}, {0x3e80}, {0xc040}}; /* 1, 2, 0.25, -3 */
    float s_bad[3] = {1, 2, 3};
    float s_inf = INFINITY;
    dit_tensor tq = dit_tensor_2d(q, DIT_F8_E4M3, 4, 64);
    dit_tensor ts = dit_tensor_1d(&s_tensor, DIT_F32, 1);
    dit_tensor tr = dit_tensor_2d(s_rows, DIT_BF16, 4, 1);
    dit_tensor tb = dit_tensor_1d(s_bad, DIT_F32, 3);
    dit_tensor ti = dit_tensor_make(&s_inf, DIT_F32, 0, NULL);
    dit_st_write_item items[] = {{"w.weight", &tq},
                                 {"w.weight_scale", &ts},
                                 {"w.row_scale", &tr},
                                 {"w.bad_scale", &tb},
                                 {"w.inf_scale", &ti}};
    write_ok(p, items, 5);

    /* The header spells the dtype as safetensors does. */
    FILE *fp = fopen(p, "rb");
    ck_assert_ptr_nonnull(fp);
    char head[1024] = {0};
    ck_assert_uint_gt(fread(head, 1, sizeof head - 1, fp), 8);
    fclose(fp);
    ck_assert_ptr_nonnull(strstr(head + 8, "\"dtype\":\"F8_E4M3\""));

    dit_st_file *f = open_ok(p);
    const dit_st_entry *w = dit_st_file_find(f, "w.weight");
    ck_assert_ptr_nonnull(w);
    ck_assert_int_eq(w->view.dtype, DIT_F8_E4M3);
    ck_assert_int_eq(w->view.ndim, 2);
    ck_assert_int_eq(w->view.nb[0], 64);
    ck_assert_int_eq(w->view.nb[1], 1);
    ck_assert_mem_eq(w->view.data, q, sizeof q);
    const dit_st_entry *scale = dit_st_file_find(f, "w.weight_scale");
    const dit_st_entry *rows = dit_st_file_find(f, "w.row_scale");
    ck_assert_ptr_nonnull(scale);
    ck_assert_ptr_nonnull(rows);
    float sv = 0;
    ck_assert_int_eq(dit_st_entry_scalar(scale, &sv, NULL), DIT_OK);
    ck_assert_float_eq(sv, 0.03125f);

    /* No scale: the exact values. */
    float out[256];
    ck_assert_int_eq(dit_st_entry_convert(w, NULL, DIT_F32, out, sizeof out, NULL), DIT_OK);
    for (int i = 0; i < 256; i++) {
        float want = dit_f8e4m3_to_f32((uint8_t)i);
        ck_assert(isnan(want) ? isnan(out[i]) : out[i] == want);
    }
    /* Per-tensor scale (a power of two: exact). */
    ck_assert_int_eq(dit_st_entry_convert(w, scale, DIT_F32, out, sizeof out, NULL), DIT_OK);
    for (int i = 0; i < 256; i++) {
        float want = dit_f8e4m3_to_f32((uint8_t)i) * 0.03125f;
        ck_assert(isnan(want) ? isnan(out[i]) : out[i] == want);
    }
    ck_assert_float_eq(out[0x7e], 14.0f); /* 448 / 32 */
    /* Per-row scale, to bf16 (E4M3 times a power of two, or times -3: at
     * most 5 significant bits, exact in bf16). */
    uint16_t ob[256];
    ck_assert_int_eq(dit_st_entry_convert(w, rows, DIT_BF16, ob, sizeof ob, NULL), DIT_OK);
    const float rs[4] = {1.0f, 2.0f, 0.25f, -3.0f};
    for (int i = 0; i < 256; i++) {
        float want = dit_f8e4m3_to_f32((uint8_t)i) * rs[i / 64];
        float got = dit_bf16_to_f32(ob[i]);
        ck_assert(isnan(want) ? isnan(got) : got == want);
    }

    /* Refusals name the file and the tensors. */
    dit_diag d;
    dit_diag_clear(&d);
    const dit_st_entry *bad = dit_st_file_find(f, "w.bad_scale");
    ck_assert_int_eq(dit_st_entry_convert(w, bad, DIT_F32, out, sizeof out, &d), DIT_ERR_FORMAT);
    ck_assert_ptr_nonnull(strstr(d.msg, "fp8.safetensors"));
    ck_assert_ptr_nonnull(strstr(d.msg, "'w.bad_scale' has shape (3)"));
    ck_assert_ptr_nonnull(strstr(d.msg, "tensor 'w.weight'"));
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_st_entry_scalar(bad, &sv, &d), DIT_ERR_FORMAT);
    ck_assert_ptr_nonnull(strstr(d.msg, "tensor 'w.bad_scale': shape (3) is not a single value"));
    dit_diag_clear(&d);
    const dit_st_entry *inf = dit_st_file_find(f, "w.inf_scale");
    ck_assert_int_eq(dit_st_entry_convert(w, inf, DIT_F32, out, sizeof out, &d), DIT_ERR_FORMAT);
    ck_assert_ptr_nonnull(strstr(d.msg, "not finite"));
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_st_entry_convert(w, NULL, DIT_F32, out, sizeof out - 4, &d),
                     DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(d.msg, "256 elements do not fit 1020 bytes of f32"));
    dit_st_file_close(f);
}
END_TEST

/* F8_E4M3 by hand (no writer), at an odd data offset. */
START_TEST(test_f8_e4m3_by_hand)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "hand.safetensors");
    const unsigned char data[] = {0xff, 0x38, 0xb8, 0x7e, 0x01, 0x7f};
    write_st(p,
             "{\"x\":{\"dtype\":\"F8_E4M3\",\"shape\":[1,1,1,1,5],\"data_offsets\":[1,6]},"
             "\"pad\":{\"dtype\":\"F8_E4M3\",\"shape\":[],\"data_offsets\":[0,1]}}",
             data, sizeof data);
    dit_st_file *f = open_ok(p);
    const dit_st_entry *e = dit_st_file_find(f, "x");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ndim, 5);
    ck_assert_int_eq(dit_tensor_numel(&e->view), 5);
    float out[5];
    ck_assert_int_eq(dit_st_entry_convert(e, NULL, DIT_F32, out, sizeof out, NULL), DIT_OK);
    ck_assert_float_eq(out[0], 1.0f);
    ck_assert_float_eq(out[1], -1.0f);
    ck_assert_float_eq(out[2], 448.0f);
    ck_assert_float_eq(out[3], 0x1p-9f);
    ck_assert(isnan(out[4]));
    /* A scalar F8 scale (-NaN here) is read like any other. */
    float sv = 0;
    ck_assert_int_eq(dit_st_entry_scalar(dit_st_file_find(f, "pad"), &sv, NULL), DIT_OK);
    ck_assert(isnan(sv));
    dit_st_file_close(f);
    /* A size that disagrees with one byte per element is refused. */
    join(p, dir, "short.safetensors");
    write_st(p, "{\"x\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,3],\"data_offsets\":[0,5]}}", data, 5);
    expect_open_fail(p, DIT_ERR_FORMAT, "tensor 'x'", "(2, 3) F8_E4M3 needs 6 bytes", NULL);
}
END_TEST

/* tests/data/fp8/e4m3_torch.safetensors (tests/golden/gen_fp8_golden.py):
 * torch's own conversions, in a file the safetensors library wrote. */
START_TEST(test_f8_e4m3_matches_torch)
{
    const char *root = getenv("DIT_SOURCE_ROOT");
    ck_assert_msg(root != NULL, "DIT_SOURCE_ROOT is not set; run this test through meson");
    char p[PATH_MAX];
    fmt_path(p, "%s/tests/data/fp8/e4m3_torch.safetensors", root);
    dit_st_file *f = open_ok(p);
    const dit_st_entry *pat = dit_st_file_find(f, "patterns");
    const dit_st_entry *to = dit_st_file_find(f, "to_f32");
    const dit_st_entry *in = dit_st_file_find(f, "inputs");
    const dit_st_entry *from = dit_st_file_find(f, "from_f32");
    ck_assert(pat && to && in && from);
    ck_assert_int_eq(pat->view.dtype, DIT_F8_E4M3);
    ck_assert_int_eq(from->view.dtype, DIT_F8_E4M3);
    ck_assert_int_eq(dit_tensor_numel(&pat->view), 256);
    ck_assert_int_eq(dit_tensor_numel(&to->view), 256);
    /* Every pattern to f32, bit for bit (NaN payloads included). */
    float got[256];
    ck_assert_int_eq(dit_st_entry_convert(pat, NULL, DIT_F32, got, sizeof got, NULL), DIT_OK);
    ck_assert_mem_eq(got, to->view.data, sizeof got);
    /* f32 to E4M3: ties, one ulp either side, overflow, random values. */
    const int64_t n = dit_tensor_numel(&in->view);
    ck_assert_int_eq(dit_tensor_numel(&from->view), n);
    ck_assert_int_gt(n, 4096);
    float *x = malloc((size_t)n * sizeof *x);
    uint8_t *q = malloc((size_t)n);
    ck_assert(x && q);
    memcpy(x, in->view.data, (size_t)n * sizeof *x);
    dit_convert_from_f32(q, DIT_F8_E4M3, x, (size_t)n);
    const uint8_t *want = from->view.data;
    for (int64_t i = 0; i < n; i++)
        ck_assert_msg(q[i] == want[i], "inputs[%lld] = %a: 0x%02x, torch 0x%02x", (long long)i,
                      (double)x[i], q[i], want[i]);
    free(x);
    free(q);
    dit_st_file_close(f);
}
END_TEST

START_TEST(test_write_errors)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    float v[2] = {1, 2};
    dit_tensor t = dit_tensor_1d(v, DIT_F32, 2);
    dit_diag d;

    /* A missing directory: the message names the path and the errno text. */
    join(p, dir, "no/such/dir/out.safetensors");
    dit_st_write_item items[] = {{"a", &t}, {"a", &t}};
    dit_diag_clear(&d);
    ck_assert_int_ne(dit_st_write(p, items, 1, &d), DIT_OK);
    ck_assert_ptr_nonnull(strstr(d.msg, "out.safetensors"));
    ck_assert_ptr_nonnull(strstr(d.msg, "No such file or directory"));

    join(p, dir, "dup.safetensors");
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_st_write(p, items, 2, &d), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(d.msg, "'a'"));
    ck_assert(!file_exists(p));

    dit_st_write_item meta[] = {{"__metadata__", &t}};
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_st_write(p, meta, 1, &d), DIT_ERR_INVALID_ARG);
    ck_assert(!file_exists(p));

    /* An empty set of tensors is a valid file. */
    join(p, dir, "none.safetensors");
    write_ok(p, NULL, 0);
    dit_st_file *f = open_ok(p);
    ck_assert_uint_eq(dit_st_file_count(f), 0);
    ck_assert_ptr_null(dit_st_file_find(f, "a"));
    dit_st_file_close(f);
}
END_TEST

START_TEST(test_zero_size_tensor)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    /* By hand: an empty tensor at the end of the data and one whose offset
     * falls inside another tensor (it occupies no bytes, so no overlap). */
    join(p, dir, "zero.safetensors");
    write_st_zeros(p,
                   "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"e0\":{\"dtype\":\"BF16\",\"shape\":[0,4],\"data_offsets\":[8,8]},"
                   "\"e1\":{\"dtype\":\"F16\",\"shape\":[3,0],\"data_offsets\":[4,4]}}",
                   8);
    dit_st_file *f = open_ok(p);
    ck_assert_uint_eq(dit_st_file_count(f), 3);
    const dit_st_entry *e = dit_st_file_find(f, "e0");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ndim, 2);
    ck_assert_int_eq(e->view.ne[0], 0);
    ck_assert_int_eq(e->view.ne[1], 4);
    ck_assert_int_eq(dit_tensor_numel(&e->view), 0);
    e = dit_st_file_find(f, "e1");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(dit_tensor_numel(&e->view), 0);
    dit_st_file_close(f);

    /* Through the writer, with a NULL data pointer. */
    join(p, dir, "zero_w.safetensors");
    int64_t shape[3] = {2, 0, 5};
    dit_tensor t = dit_tensor_make(NULL, DIT_BF16, 3, shape);
    dit_st_write_item items[] = {{"empty", &t}};
    write_ok(p, items, 1);
    f = open_ok(p);
    e = dit_st_file_find(f, "empty");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.ndim, 3);
    ck_assert_int_eq(e->view.ne[2], 5);
    ck_assert_int_eq(dit_tensor_numel(&e->view), 0);
    dit_st_file_close(f);
}
END_TEST

START_TEST(test_metadata)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "meta.safetensors");
    write_st_zeros(p,
                   "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"h\\u00e9llo\"},"
                   "\"w\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}   ",
                   4);
    dit_st_file *f = open_ok(p);
    ck_assert_uint_eq(dit_st_file_count(f), 1); /* __metadata__ is no tensor */
    ck_assert_str_eq(dit_st_file_metadata(f, "format"), "pt");
    ck_assert_str_eq(dit_st_file_metadata(f, "note"), "h\xc3\xa9llo");
    ck_assert_ptr_null(dit_st_file_metadata(f, "missing"));
    ck_assert_ptr_null(dit_st_file_find(f, "__metadata__"));
    dit_st_file_close(f);

    /* No __metadata__ at all. */
    join(p, dir, "nometa.safetensors");
    write_st(p, "{}", NULL, 0);
    f = open_ok(p);
    ck_assert_uint_eq(dit_st_file_count(f), 0);
    ck_assert_ptr_null(dit_st_file_metadata(f, "format"));
    dit_st_file_close(f);
}
END_TEST

START_TEST(test_misaligned_offsets)
{
    /* Offsets need not respect dtype alignment; views are still exact. */
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "odd.safetensors");
    const char *header = "{\"pad\":{\"dtype\":\"F16\",\"shape\":[],\"data_offsets\":[0,2]},"
                         "\"byte\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[2,4]},"
                         "\"f\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[5,13]}}";
    unsigned char data[13] = {0};
    float vals[2] = {6.5f, -1.0f};
    memcpy(data + 5, vals, 8);
    write_st(p, header, data, sizeof data);
    dit_st_file *f = open_ok(p);
    const dit_st_entry *e = dit_st_file_find(f, "f");
    ck_assert_ptr_nonnull(e);
    float got[2];
    memcpy(got, e->view.data, sizeof got);
    ck_assert_float_eq(got[0], 6.5f);
    ck_assert_float_eq(got[1], -1.0f);
    dit_st_file_close(f);
}
END_TEST

/* ---- sharded sets ------------------------------------------------------------ */

static const char *const shard1_names[] = {"a", "c"};
static const char *const shard2_names[] = {"b", "d"};
#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

static void write_two_shards(const char *dir)
{
    char p[PATH_MAX];
    join(p, dir, SHARD1);
    write_shard(p, shard1_names, 2);
    join(p, dir, SHARD2);
    write_shard(p, shard2_names, 2);
}

static void check_sharded_set(const dit_st_set *s, const char *dir)
{
    ck_assert_uint_eq(dit_st_set_count(s), 4);
    static const char *const want[] = {"a", "b", "c", "d"};
    for (size_t i = 0; i < 4; i++)
        ck_assert_str_eq(dit_st_set_at(s, i)->name, want[i]);
    ck_assert_ptr_null(dit_st_set_at(s, 4));
    for (size_t i = 0; i < 4; i++) {
        const dit_st_entry *e = dit_st_set_find(s, want[i]);
        ck_assert_ptr_nonnull(e);
        char shard[PATH_MAX];
        join(shard, dir, (i == 0 || i == 2) ? SHARD1 : SHARD2);
        ck_assert_str_eq(e->file, shard);
        float v[2];
        memcpy(v, e->view.data, sizeof v);
        ck_assert_float_eq(v[0], (float)want[i][0]);
        ck_assert_float_eq(v[1], (float)want[i][0] + 0.5f);
    }
    ck_assert_ptr_null(dit_st_set_find(s, "e"));
}

START_TEST(test_sharded_set)
{
    TEST_DIR(dir);
    write_two_shards(dir);
    char idx[PATH_MAX];
    join(idx, dir, "model.safetensors.index.json");
    write_index(idx, "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD2 "\", \"c\": \"" SHARD1
                     "\", \"d\": \"" SHARD2 "\"");

    dit_diag d;
    dit_diag_clear(&d);
    dit_st_set *s = NULL;
    ck_assert_msg(dit_st_set_open_dir(dir, "model", &s, &d) == DIT_OK, "%s", d.msg);
    check_sharded_set(s, dir);
    dit_st_set_close(s);

    s = NULL;
    ck_assert_msg(dit_st_set_open_path(idx, &s, &d) == DIT_OK, "%s", d.msg);
    check_sharded_set(s, dir);
    dit_st_set_close(s);
}
END_TEST

START_TEST(test_single_file_set)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    join(p, dir, "diffusion_pytorch_model.safetensors");
    static const char *const names[] = {"z", "m", "q"};
    write_shard(p, names, 3);
    /* A stale index beside it is ignored: the single file wins. */
    char idx[PATH_MAX];
    join(idx, dir, "diffusion_pytorch_model.safetensors.index.json");
    write_bytes(idx, "garbage", 7);

    dit_diag d;
    dit_diag_clear(&d);
    dit_st_set *s = NULL;
    ck_assert_msg(dit_st_set_open_dir(dir, "diffusion_pytorch_model", &s, &d) == DIT_OK, "%s",
                  d.msg);
    ck_assert_uint_eq(dit_st_set_count(s), 3);
    ck_assert_str_eq(dit_st_set_at(s, 0)->name, "m");
    ck_assert_str_eq(dit_st_set_at(s, 2)->name, "z");
    ck_assert_str_eq(dit_st_set_find(s, "q")->file, p);
    dit_st_set_close(s);

    s = NULL;
    ck_assert_msg(dit_st_set_open_path(p, &s, &d) == DIT_OK, "%s", d.msg);
    ck_assert_uint_eq(dit_st_set_count(s), 3);
    dit_st_set_close(s);
}
END_TEST

START_TEST(test_open_dir_not_found)
{
    TEST_DIR(dir);
    char single[PATH_MAX], idx[PATH_MAX];
    join(single, dir, "model.safetensors");
    join(idx, dir, "model.safetensors.index.json");
    dit_diag d;
    dit_diag_clear(&d);
    dit_st_set *s = NULL;
    ck_assert_int_eq(dit_st_set_open_dir(dir, "model", &s, &d), DIT_ERR_NOT_FOUND);
    ck_assert_ptr_null(s);
    ck_assert_msg(strstr(d.msg, single) != NULL, "'%s' lacks %s", d.msg, single);
    ck_assert_msg(strstr(d.msg, idx) != NULL, "'%s' lacks %s", d.msg, idx);

    /* The directory itself missing: the same answer. */
    char nodir[PATH_MAX];
    join(nodir, dir, "nope");
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_st_set_open_dir(nodir, "model", &s, &d), DIT_ERR_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(d.msg, "nope/model.safetensors.index.json"));
}
END_TEST

START_TEST(test_sharded_missing_shard_file)
{
    TEST_DIR(dir);
    write_two_shards(dir);
    char idx[PATH_MAX];
    join(idx, dir, "model.safetensors.index.json");
    write_index(idx, "\"a\": \"" SHARD1 "\", \"c\": \"" SHARD1 "\", \"b\": \"gone.safetensors\"");
    expect_set_fail(idx, DIT_ERR_NOT_FOUND, "model.safetensors.index.json", "gone.safetensors",
                    NULL);
}
END_TEST

START_TEST(test_sharded_tensor_missing_from_shard)
{
    TEST_DIR(dir);
    write_two_shards(dir);
    char idx[PATH_MAX];
    join(idx, dir, "model.safetensors.index.json");
    write_index(idx, "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD2 "\", \"c\": \"" SHARD1
                     "\", \"d\": \"" SHARD2 "\", \"x.weight\": \"" SHARD2 "\"");
    expect_set_fail(idx, DIT_ERR_FORMAT, "model.safetensors.index.json", "tensor 'x.weight'",
                    SHARD2, NULL);
}
END_TEST

START_TEST(test_sharded_tensor_not_in_index)
{
    TEST_DIR(dir);
    write_two_shards(dir);
    char idx[PATH_MAX];
    join(idx, dir, "model.safetensors.index.json");
    write_index(idx, "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD2 "\", \"d\": \"" SHARD2 "\"");
    expect_set_fail(idx, DIT_ERR_FORMAT, SHARD1, "tensor 'c'", "not listed",
                    "model.safetensors.index.json", NULL);
}
END_TEST

START_TEST(test_sharded_tensor_listed_for_other_shard)
{
    TEST_DIR(dir);
    write_two_shards(dir);
    char idx[PATH_MAX];
    join(idx, dir, "model.safetensors.index.json");
    /* "c" lives in shard 1 but the index puts it in shard 2. */
    write_index(idx, "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD2 "\", \"c\": \"" SHARD2
                     "\", \"d\": \"" SHARD2 "\"");
    expect_set_fail(idx, DIT_ERR_FORMAT, SHARD1, "tensor 'c'", SHARD2, NULL);
}
END_TEST

START_TEST(test_sharded_tensor_in_two_shards)
{
    TEST_DIR(dir);
    char p[PATH_MAX];
    static const char *const s1[] = {"a", "c"}, *const s2[] = {"b", "c"};
    join(p, dir, SHARD1);
    write_shard(p, s1, 2);
    join(p, dir, SHARD2);
    write_shard(p, s2, 2);
    char idx[PATH_MAX];
    join(idx, dir, "model.safetensors.index.json");
    write_index(idx, "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD2 "\", \"c\": \"" SHARD1 "\"");
    expect_set_fail(idx, DIT_ERR_FORMAT, "tensor 'c'", SHARD1, SHARD2, NULL);
}
END_TEST

START_TEST(test_sharded_path_traversal)
{
    static const char *const bad[] = {"../" SHARD1, "sub/" SHARD1, "/etc/passwd", "..", ".", ""};
    TEST_DIR(dir);
    write_two_shards(dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char idx[PATH_MAX], name[64], body[512];
        snprintf(name, sizeof name, "m%zu.safetensors.index.json", i);
        join(idx, dir, name);
        snprintf(body, sizeof body, "\"a\": \"" SHARD1 "\", \"evil.w\": \"%s\"", bad[i]);
        write_index(idx, body);
        char want[128];
        snprintf(want, sizeof want, "shard '%s' is not a plain file name", bad[i]);
        expect_set_fail(idx, DIT_ERR_FORMAT, name, "tensor 'evil.w'", want, NULL);
    }
}
END_TEST

START_TEST(test_sharded_bad_index)
{
    TEST_DIR(dir);
    write_two_shards(dir);
    char idx[PATH_MAX];
    join(idx, dir, "bad.safetensors.index.json");
    write_bytes(idx, "{\"weight_map\": {\"a\": ", 21);
    expect_set_fail(idx, DIT_ERR_FORMAT, "bad.safetensors.index.json", "not valid JSON", NULL);

    write_bytes(idx, "[]", 2);
    expect_set_fail(idx, DIT_ERR_FORMAT, "bad.safetensors.index.json", "not a JSON object", NULL);

    write_bytes(idx, "{\"metadata\": {}}", 16);
    expect_set_fail(idx, DIT_ERR_FORMAT, "bad.safetensors.index.json", "missing \"weight_map\"",
                    NULL);

    const char *arr = "{\"weight_map\": [\"a\"]}";
    write_bytes(idx, arr, strlen(arr));
    expect_set_fail(idx, DIT_ERR_FORMAT, "bad.safetensors.index.json", "not a JSON object", NULL);

    write_index(idx, "\"a\": \"" SHARD1 "\", \"c\": 3");
    expect_set_fail(idx, DIT_ERR_FORMAT, "bad.safetensors.index.json", "tensor 'c'", "not a string",
                    NULL);

    write_index(idx, "\"a\": \"" SHARD1 "\", \"c\": \"" SHARD1 "\", \"a\": \"" SHARD1 "\"");
    expect_set_fail(idx, DIT_ERR_FORMAT, "bad.safetensors.index.json", "tensor 'a'", "twice", NULL);

    /* A broken shard: its own message, with the index as context. */
    char p[PATH_MAX];
    join(p, dir, "broken.safetensors");
    write_st_zeros(p, "{\"k\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8);
    write_index(idx, "\"k\": \"broken.safetensors\"");
    expect_set_fail(idx, DIT_ERR_UNSUPPORTED, "bad.safetensors.index.json", "broken.safetensors",
                    "tensor 'k'", "dtype 'I64'", NULL);
}
END_TEST

static Suite *safetensors_suite(void)
{
    Suite *s = suite_create("safetensors");

    TCase *bad = tcase_create("malformed");
    tcase_add_unchecked_fixture(bad, tmp_setup, tmp_teardown);
    tcase_add_test(bad, test_file_shorter_than_8);
    tcase_add_test(bad, test_missing_file);
    tcase_add_test(bad, test_directory_not_file);
    tcase_add_test(bad, test_header_length_past_end);
    tcase_add_test(bad, test_header_length_absurd);
    tcase_add_test(bad, test_truncated_data);
    tcase_add_test(bad, test_bad_json);
    tcase_add_test(bad, test_trailing_garbage);
    tcase_add_test(bad, test_header_not_object);
    tcase_add_test(bad, test_entry_not_object);
    tcase_add_test(bad, test_unknown_dtype);
    tcase_add_test(bad, test_missing_dtype);
    tcase_add_test(bad, test_dtype_not_string);
    tcase_add_test(bad, test_missing_shape);
    tcase_add_test(bad, test_shape_not_array);
    tcase_add_test(bad, test_missing_offsets);
    tcase_add_test(bad, test_offsets_ill_typed);
    tcase_add_test(bad, test_negative_shape);
    tcase_add_test(bad, test_non_integer_shape);
    tcase_add_test(bad, test_too_many_dims);
    tcase_add_test(bad, test_offsets_begin_after_end);
    tcase_add_test(bad, test_offsets_past_end);
    tcase_add_test(bad, test_overlapping_tensors);
    tcase_add_test(bad, test_size_mismatch);
    tcase_add_test(bad, test_shape_overflow);
    tcase_add_test(bad, test_duplicate_names);
    tcase_add_test(bad, test_bad_metadata);
    tcase_add_test(bad, test_truncations_and_corruptions);
    suite_add_tcase(s, bad);

    TCase *good = tcase_create("valid");
    tcase_add_unchecked_fixture(good, tmp_setup, tmp_teardown);
    tcase_add_test(good, test_roundtrip_dtypes);
    tcase_add_test(good, test_write_strided);
    tcase_add_test(good, test_five_dims);
    tcase_add_test(good, test_f8_e4m3_with_scales);
    tcase_add_test(good, test_f8_e4m3_by_hand);
    tcase_add_test(good, test_f8_e4m3_matches_torch);
    tcase_add_test(good, test_write_errors);
    tcase_add_test(good, test_zero_size_tensor);
    tcase_add_test(good, test_metadata);
    tcase_add_test(good, test_misaligned_offsets);
    suite_add_tcase(s, good);

    TCase *sets = tcase_create("sets");
    tcase_add_unchecked_fixture(sets, tmp_setup, tmp_teardown);
    tcase_add_test(sets, test_sharded_set);
    tcase_add_test(sets, test_single_file_set);
    tcase_add_test(sets, test_open_dir_not_found);
    tcase_add_test(sets, test_sharded_missing_shard_file);
    tcase_add_test(sets, test_sharded_tensor_missing_from_shard);
    tcase_add_test(sets, test_sharded_tensor_not_in_index);
    tcase_add_test(sets, test_sharded_tensor_listed_for_other_shard);
    tcase_add_test(sets, test_sharded_tensor_in_two_shards);
    tcase_add_test(sets, test_sharded_path_traversal);
    tcase_add_test(sets, test_sharded_bad_index);
    suite_add_tcase(s, sets);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(safetensors_suite());
    srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY picks the output; normal by default */
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
