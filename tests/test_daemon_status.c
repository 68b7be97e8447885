/* The one mapping from dit_status to gRPC status codes
 * (daemon/status_map.c), as design §7 and the API's comments promise. */
#include <check.h>
#include <stdlib.h>

#include "status_map.h"

START_TEST(each_status_maps_to_its_grpc_code)
{
    static const struct {
        dit_status st;
        grpc_status_code code;
    } cases[] = {
        {DIT_OK, GRPC_STATUS_OK},
        {DIT_ERR_INVALID_ARG, GRPC_STATUS_INVALID_ARGUMENT},
        {DIT_ERR_FORMAT, GRPC_STATUS_INVALID_ARGUMENT},
        {DIT_ERR_NOT_FOUND, GRPC_STATUS_NOT_FOUND},
        {DIT_ERR_NOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED},
        {DIT_ERR_PEER, GRPC_STATUS_UNAVAILABLE},
        {DIT_ERR_TIMEOUT, GRPC_STATUS_UNAVAILABLE},
        {DIT_ERR_DEVICE, GRPC_STATUS_UNAVAILABLE},
        {DIT_ERR_UNSUPPORTED, GRPC_STATUS_UNIMPLEMENTED},
        {DIT_ERR_CANCELLED, GRPC_STATUS_CANCELLED},
        {DIT_ERR_IO, GRPC_STATUS_INTERNAL},
        {DIT_ERR_INTERNAL, GRPC_STATUS_INTERNAL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ck_assert_msg(dit_status_to_grpc(cases[i].st) == cases[i].code, "%s -> %d, want %d",
                      dit_status_name(cases[i].st), (int)dit_status_to_grpc(cases[i].st),
                      (int)cases[i].code);
}
END_TEST

START_TEST(unknown_values_are_internal)
{
    ck_assert_int_eq(dit_status_to_grpc((dit_status)9999), GRPC_STATUS_INTERNAL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon_status");
    TCase *tc = tcase_create("mapping");
    tcase_add_test(tc, each_status_maps_to_its_grpc_code);
    tcase_add_test(tc, unknown_values_are_internal);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
