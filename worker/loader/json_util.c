#include "loader/json_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

dit_status dit_json_load_file(const char *path, cJSON **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return dit_diag_set(diag, errno == ENOENT ? DIT_ERR_NOT_FOUND : DIT_ERR_IO,
                            "%s: cannot open: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) {
        st = dit_diag_set(diag, DIT_ERR_IO, "%s: cannot seek: %s", path, strerror(errno));
        goto cleanup;
    }
    long size = ftell(f);
    if (size < 0 || (unsigned long)size > DIT_JSON_MAX_BYTES) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: size %ld is not that of a JSON config", path,
                          size);
        goto cleanup;
    }
    rewind(f);
    buf = malloc((size_t)size + 1);
    if (!buf) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) {
        st = dit_diag_set(diag, DIT_ERR_IO, "%s: short read", path);
        goto cleanup;
    }
    buf[size] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, (size_t)size, &end, 0);
    if (!root) {
        long at = end ? (long)(end - buf) : -1;
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: invalid JSON near byte %ld", path, at);
        goto cleanup;
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: top level is not a JSON object", path);
        goto cleanup;
    }
    *out = root;
cleanup:
    free(buf);
    fclose(f);
    return st;
}

static const cJSON *field(const cJSON *obj, const char *key)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (it && !cJSON_IsNull(it)) ? it : NULL;
}

dit_status dit_json_get_int(const cJSON *obj, const char *key, const char *path, bool required,
                            int64_t def, int64_t lo, int64_t hi, int64_t *out, dit_diag *diag)
{
    const cJSON *it = field(obj, key);
    if (!it) {
        if (required)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: missing required key \"%s\"", path, key);
        *out = def;
        return DIT_OK;
    }
    double v = cJSON_GetNumberValue(it);
    if (!cJSON_IsNumber(it) || v != floor(v) || fabs(v) > 9007199254740992.0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" must be an integer", path, key);
    if ((int64_t)v < lo || (int64_t)v > hi)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" = %lld is outside [%lld, %lld]", path,
                            key, (long long)v, (long long)lo, (long long)hi);
    *out = (int64_t)v;
    return DIT_OK;
}

dit_status dit_json_get_bool(const cJSON *obj, const char *key, const char *path, bool required,
                             bool def, bool *out, dit_diag *diag)
{
    const cJSON *it = field(obj, key);
    if (!it) {
        if (required)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: missing required key \"%s\"", path, key);
        *out = def;
        return DIT_OK;
    }
    if (!cJSON_IsBool(it))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(it);
    return DIT_OK;
}

dit_status dit_json_get_double(const cJSON *obj, const char *key, const char *path, bool required,
                               double def, double *out, dit_diag *diag)
{
    const cJSON *it = field(obj, key);
    if (!it) {
        if (required)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: missing required key \"%s\"", path, key);
        *out = def;
        return DIT_OK;
    }
    if (!cJSON_IsNumber(it))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" must be a number", path, key);
    *out = cJSON_GetNumberValue(it);
    return DIT_OK;
}

dit_status dit_json_get_int_array(const cJSON *obj, const char *key, const char *path, int64_t *out,
                                  int cap, int *n, dit_diag *diag)
{
    const cJSON *it = field(obj, key);
    if (!it || !cJSON_IsArray(it))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" must be an array of integers", path,
                            key);
    int count = cJSON_GetArraySize(it);
    if (count > cap)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" has %d entries, at most %d supported",
                            path, key, count, cap);
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, it)
    {
        double v = cJSON_GetNumberValue(el);
        if (!cJSON_IsNumber(el) || v != floor(v) || fabs(v) > 9007199254740992.0)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\"[%d] must be an integer", path,
                                key, i);
        out[i++] = (int64_t)v;
    }
    *n = count;
    return DIT_OK;
}

dit_status dit_json_get_string(const cJSON *obj, const char *key, const char *path, bool required,
                               const char **out, dit_diag *diag)
{
    const cJSON *it = field(obj, key);
    if (!it) {
        if (required)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: missing required key \"%s\"", path, key);
        *out = NULL;
        return DIT_OK;
    }
    if (!cJSON_IsString(it))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" must be a string", path, key);
    *out = cJSON_GetStringValue(it);
    return DIT_OK;
}
