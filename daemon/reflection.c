#include "reflection.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "google_protobuf_descriptor.pb-c.h"
#include "grpc_reflection_v1_reflection.pb-c.h"

typedef struct refl_file {
    const char *name;
    uint8_t *bytes; /* the FileDescriptorProto, serialized */
    size_t len;
    const Google__Protobuf__FileDescriptorProto *fd;
} refl_file;

typedef struct refl_symbol {
    char *name; /* fully qualified, no leading dot */
    int file;
} refl_symbol;

struct dit_reflection {
    Google__Protobuf__FileDescriptorSet *set;
    refl_file *files;
    size_t n_files;
    refl_symbol *symbols;
    size_t n_symbols, cap_symbols;
    char **services;
    int n_services;
};

static int add_symbol(dit_reflection *r, const char *prefix, const char *name, int file)
{
    if (r->n_symbols == r->cap_symbols) {
        size_t cap = r->cap_symbols ? r->cap_symbols * 2 : 128;
        refl_symbol *ns = realloc(r->symbols, cap * sizeof *ns);
        if (!ns)
            return -1;
        r->symbols = ns;
        r->cap_symbols = cap;
    }
    size_t n = strlen(prefix) + strlen(name) + 2;
    char *full = malloc(n);
    if (!full)
        return -1;
    snprintf(full, n, "%s%s%s", prefix, *prefix ? "." : "", name);
    r->symbols[r->n_symbols++] = (refl_symbol){full, file};
    return 0;
}

/* An enum and its values; protobuf scopes values beside the enum, not in it. */
static int add_enum(dit_reflection *r, const char *prefix,
                    const Google__Protobuf__EnumDescriptorProto *e, int file)
{
    if (add_symbol(r, prefix, e->name, file) != 0)
        return -1;
    for (size_t i = 0; i < e->n_value; i++)
        if (add_symbol(r, prefix, e->value[i]->name, file) != 0)
            return -1;
    return 0;
}

static int add_message(dit_reflection *r, const char *prefix,
                       const Google__Protobuf__DescriptorProto *m, int file)
{
    if (add_symbol(r, prefix, m->name, file) != 0)
        return -1;
    const refl_symbol *self = &r->symbols[r->n_symbols - 1];
    char *scope = strdup(self->name);
    if (!scope)
        return -1;
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < m->n_nested_type; i++)
        rc = add_message(r, scope, m->nested_type[i], file);
    for (size_t i = 0; rc == 0 && i < m->n_enum_type; i++)
        rc = add_enum(r, scope, m->enum_type[i], file);
    /* Fields and oneofs are symbols too (grpcurl describes them). */
    for (size_t i = 0; rc == 0 && i < m->n_field; i++)
        rc = add_symbol(r, scope, m->field[i]->name, file);
    for (size_t i = 0; rc == 0 && i < m->n_oneof_decl; i++)
        rc = add_symbol(r, scope, m->oneof_decl[i]->name, file);
    free(scope);
    return rc;
}

dit_status dit_reflection_create(const uint8_t *set, size_t len, const char *const *services,
                                 int n_services, dit_reflection **out, dit_diag *diag)
{
    dit_reflection *r = calloc(1, sizeof *r);
    if (!r)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    r->set = google__protobuf__file_descriptor_set__unpack(NULL, len, set);
    if (!r->set) {
        free(r);
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "the embedded descriptor set does not parse");
    }
    r->n_files = r->set->n_file;
    r->files = calloc(r->n_files, sizeof *r->files);
    r->services = calloc((size_t)n_services, sizeof *r->services);
    if (!r->files || !r->services)
        goto oom;
    for (int i = 0; i < n_services; i++)
        if (!(r->services[r->n_services++] = strdup(services[i])))
            goto oom;
    for (size_t f = 0; f < r->n_files; f++) {
        const Google__Protobuf__FileDescriptorProto *fd = r->set->file[f];
        refl_file *rf = &r->files[f];
        rf->fd = fd;
        rf->name = fd->name;
        rf->len = google__protobuf__file_descriptor_proto__get_packed_size(fd);
        rf->bytes = malloc(rf->len ? rf->len : 1);
        if (!rf->bytes)
            goto oom;
        google__protobuf__file_descriptor_proto__pack(fd, rf->bytes);
        const char *pkg = fd->package ? fd->package : "";
        for (size_t i = 0; i < fd->n_message_type; i++)
            if (add_message(r, pkg, fd->message_type[i], (int)f) != 0)
                goto oom;
        for (size_t i = 0; i < fd->n_enum_type; i++)
            if (add_enum(r, pkg, fd->enum_type[i], (int)f) != 0)
                goto oom;
        for (size_t i = 0; i < fd->n_service; i++) {
            const Google__Protobuf__ServiceDescriptorProto *sd = fd->service[i];
            if (add_symbol(r, pkg, sd->name, (int)f) != 0)
                goto oom;
            char *scope = strdup(r->symbols[r->n_symbols - 1].name);
            if (!scope)
                goto oom;
            for (size_t k = 0; k < sd->n_method; k++)
                if (add_symbol(r, scope, sd->method[k]->name, (int)f) != 0) {
                    free(scope);
                    goto oom;
                }
            free(scope);
        }
    }
    *out = r;
    return DIT_OK;
oom:
    dit_reflection_free(r);
    return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
}

void dit_reflection_free(dit_reflection *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->n_files; i++)
        free(r->files[i].bytes);
    for (size_t i = 0; i < r->n_symbols; i++)
        free(r->symbols[i].name);
    for (int i = 0; i < r->n_services; i++)
        free(r->services[i]);
    free(r->files);
    free(r->symbols);
    free(r->services);
    if (r->set)
        google__protobuf__file_descriptor_set__free_unpacked(r->set, NULL);
    free(r);
}

static int file_index(const dit_reflection *r, const char *name)
{
    for (size_t i = 0; i < r->n_files; i++)
        if (strcmp(r->files[i].name, name) == 0)
            return (int)i;
    return -1;
}

/* The file and everything it imports, each once, the file first. */
static void collect(const dit_reflection *r, int f, bool *seen, int *order, size_t *n)
{
    if (f < 0 || seen[f])
        return;
    seen[f] = true;
    order[(*n)++] = f;
    const Google__Protobuf__FileDescriptorProto *fd = r->files[f].fd;
    for (size_t i = 0; i < fd->n_dependency; i++)
        collect(r, file_index(r, fd->dependency[i]), seen, order, n);
}

int dit_reflection_answer(const dit_reflection *r, const uint8_t *req, size_t len, uint8_t **resp,
                          size_t *resp_len)
{
    Grpc__Reflection__V1__ServerReflectionRequest *q =
        grpc__reflection__v1__server_reflection_request__unpack(NULL, len, req);
    if (!q)
        return -1;
    Grpc__Reflection__V1__ServerReflectionResponse out =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__INIT;
    Grpc__Reflection__V1__FileDescriptorResponse fdr =
        GRPC__REFLECTION__V1__FILE_DESCRIPTOR_RESPONSE__INIT;
    Grpc__Reflection__V1__ListServiceResponse lsr =
        GRPC__REFLECTION__V1__LIST_SERVICE_RESPONSE__INIT;
    Grpc__Reflection__V1__ErrorResponse err = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    Grpc__Reflection__V1__ServiceResponse *svc = NULL, **svcp = NULL;
    ProtobufCBinaryData *blobs = NULL;
    bool *seen = calloc(r->n_files + 1, sizeof *seen);
    int *order = calloc(r->n_files + 1, sizeof *order);
    char msg[512];
    int rc = -1;
    if (!seen || !order)
        goto cleanup;
    out.valid_host = q->host ? q->host : "";
    out.original_request = q;
    int target = -1;
    bool want_file = false;
    switch (q->message_request_case) {
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES:
        svc = calloc((size_t)r->n_services, sizeof *svc);
        svcp = calloc((size_t)r->n_services, sizeof *svcp);
        if (!svc || !svcp)
            goto cleanup;
        for (int i = 0; i < r->n_services; i++) {
            grpc__reflection__v1__service_response__init(&svc[i]);
            svc[i].name = r->services[i];
            svcp[i] = &svc[i];
        }
        lsr.n_service = (size_t)r->n_services;
        lsr.service = svcp;
        out.message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        out.list_services_response = &lsr;
        break;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME:
        want_file = true;
        target = file_index(r, q->file_by_filename);
        snprintf(msg, sizeof msg, "file %s not found", q->file_by_filename);
        break;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL: {
        want_file = true;
        const char *sym = q->file_containing_symbol;
        if (sym[0] == '.')
            sym++;
        for (size_t i = 0; i < r->n_symbols && target < 0; i++)
            if (strcmp(r->symbols[i].name, sym) == 0)
                target = r->symbols[i].file;
        snprintf(msg, sizeof msg, "symbol %s not found", sym);
        break;
    }
    default:
        err.error_code = 12; /* UNIMPLEMENTED */
        err.error_message = "extension queries are not supported (this API defines no extensions)";
        out.message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
        out.error_response = &err;
        break;
    }
    if (want_file) {
        if (target < 0) {
            err.error_code = 5; /* NOT_FOUND */
            err.error_message = msg;
            out.message_response_case =
                GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
            out.error_response = &err;
        } else {
            size_t n = 0;
            collect(r, target, seen, order, &n);
            blobs = calloc(n, sizeof *blobs);
            if (!blobs)
                goto cleanup;
            for (size_t i = 0; i < n; i++)
                blobs[i] = (ProtobufCBinaryData){r->files[order[i]].len, r->files[order[i]].bytes};
            fdr.n_file_descriptor_proto = n;
            fdr.file_descriptor_proto = blobs;
            out.message_response_case =
                GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
            out.file_descriptor_response = &fdr;
        }
    }
    *resp_len = grpc__reflection__v1__server_reflection_response__get_packed_size(&out);
    *resp = malloc(*resp_len ? *resp_len : 1);
    if (!*resp)
        goto cleanup;
    grpc__reflection__v1__server_reflection_response__pack(&out, *resp);
    rc = 0;
cleanup:
    free(svc);
    free(svcp);
    free(blobs);
    free(seen);
    free(order);
    grpc__reflection__v1__server_reflection_request__free_unpacked(q, NULL);
    return rc;
}
