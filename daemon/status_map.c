#include "status_map.h"

grpc_status_code dit_status_to_grpc(dit_status st)
{
    switch (st) {
    case DIT_OK:
        return GRPC_STATUS_OK;
    case DIT_ERR_CANCELLED:
        return GRPC_STATUS_CANCELLED;
    case DIT_ERR_INVALID_ARG:
    case DIT_ERR_FORMAT:
        return GRPC_STATUS_INVALID_ARGUMENT;
    case DIT_ERR_NOT_FOUND:
        return GRPC_STATUS_NOT_FOUND;
    case DIT_ERR_NOMEM:
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case DIT_ERR_PEER:
    case DIT_ERR_TIMEOUT:
    case DIT_ERR_DEVICE:
        return GRPC_STATUS_UNAVAILABLE;
    case DIT_ERR_UNSUPPORTED:
        return GRPC_STATUS_UNIMPLEMENTED;
    default:
        return GRPC_STATUS_INTERNAL;
    }
}
