/* ditd's settings table (daemon/config.c): the defaults, the environment
 * against the flags (flags win), and what a bad value says. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

/* Parses argv (NULL-terminated) with ditd's parser; stdout and stderr are
 * captured into out/err. Returns the parser's result. */
static int parse(dit_daemon_config *cfg, char *out, size_t outcap, char *err, size_t errcap,
                 const char *const *args)
{
    char *argv[64];
    int argc = 0;
    argv[argc++] = (char *)"ditd";
    for (; args[argc - 1] && argc < 63; argc++)
        argv[argc] = (char *)args[argc - 1];
    argv[argc] = NULL;
    fflush(stdout);
    fflush(stderr);
    FILE *fo = tmpfile(), *fe = tmpfile();
    ck_assert(fo && fe);
    const int so = dup(1), se = dup(2);
    dup2(fileno(fo), 1);
    dup2(fileno(fe), 2);
    optind = 0; /* getopt_long starts over */
    const int rc = dit_daemon_config_parse(cfg, argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(so, 1);
    dup2(se, 2);
    close(so);
    close(se);
    rewind(fo);
    rewind(fe);
    size_t n = fread(out, 1, outcap - 1, fo);
    out[n] = '\0';
    n = fread(err, 1, errcap - 1, fe);
    err[n] = '\0';
    fclose(fo);
    fclose(fe);
    return rc;
}

#define PARSE(cfg, ...)                                                                            \
    parse(cfg, out, sizeof out, err, sizeof err, (const char *const[]){__VA_ARGS__, NULL})

static void clear_env(void)
{
    /* The variables these tests set; Check forks per test, but a run with
     * CK_FORK=no shares the environment. */
    const char *vars[] = {"DITD_MODEL",    "DITD_MAX_QUEUE",     "DITD_LISTEN",
                          "DITD_LOG_JSON", "DITD_DRAIN_TIMEOUT", "DITD_RING",
                          "DITD_BACKEND",  "DITD_CFG_PARALLEL",  "DITD_LORA"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++)
        unsetenv(vars[i]);
}

static char out[65536], err[4096];

START_TEST(defaults_come_from_the_table)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--model", "/models/flux-dev/"), 0);
    ck_assert_str_eq(cfg.model, "/models/flux-dev/");
    ck_assert_str_eq(cfg.model_name, "flux-dev/");
    ck_assert_str_eq(cfg.listen, "0.0.0.0:50051");
    ck_assert_str_eq(cfg.backend_name, "cpu");
    ck_assert_int_eq(cfg.pc.world_size, 1);
    ck_assert_int_eq(cfg.pc.ring_degree, 1);
    ck_assert(cfg.pc.fp32_merge);
    ck_assert_int_eq(cfg.local_ranks, 1);
    ck_assert_int_eq(cfg.max_queue, 16);
    ck_assert_double_eq(cfg.drain_timeout_s, 30);
    ck_assert_double_eq(cfg.comm_timeout_s, 60);
    ck_assert_double_eq(cfg.job_timeout_s, 300);
    ck_assert_double_eq(cfg.startup_timeout_s, 600);
    ck_assert_int_eq(cfg.max_message_bytes, 64ll << 20);
    ck_assert_int_eq(cfg.chunk_bytes, 1 << 20);
    ck_assert_int_eq(cfg.max_unread_bytes, 128ll << 20);
    ck_assert_int_eq(cfg.max_unread_total, 1ll << 30);
    ck_assert_int_eq(cfg.max_pixels, 2048 * 2048);
    ck_assert_int_eq(cfg.metrics_port, -1);
    ck_assert_ptr_null(cfg.http_listen);
    ck_assert_ptr_null(cfg.http_cors_origins);
    ck_assert_int_eq(cfg.http_max_body_bytes, 1 << 20);
    ck_assert_int_eq(cfg.http_max_connections, 256);
    ck_assert_double_eq(cfg.http_idle_timeout_s, 30);
    ck_assert_double_eq(cfg.http_request_timeout_s, 30);
    ck_assert_int_eq(cfg.http_video_jobs, 64);
    ck_assert_int_eq(cfg.http_video_bytes, (int64_t)1 << 30);
    ck_assert_double_eq(cfg.http_video_retention_s, 3600);
    ck_assert_int_eq(cfg.max_connection_age_s, 0);
    ck_assert_int_eq(cfg.threads, 0);
    ck_assert_ptr_null(cfg.warmup);
    ck_assert_ptr_null(cfg.tls_cert);
    ck_assert_ptr_null(cfg.worker_path);
    ck_assert_int_eq(cfg.log.level, DIT_LOG_INFO);
    ck_assert(!cfg.log.json);
    ck_assert_str_eq(err, "");
}
END_TEST

START_TEST(model_name_is_the_folder_name)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--model", "/models/flux-dev"), 0);
    ck_assert_str_eq(cfg.model_name, "flux-dev");
    ck_assert_int_eq(PARSE(&cfg, "--model", "/models/flux-dev", "--model-name", "flux"), 0);
    ck_assert_str_eq(cfg.model_name, "flux");
}
END_TEST

START_TEST(environment_sets_and_flags_win)
{
    clear_env();
    setenv("DITD_MODEL", "/m/demo", 1);
    setenv("DITD_MAX_QUEUE", "5", 1);
    setenv("DITD_LOG_JSON", "yes", 1);
    setenv("DITD_DRAIN_TIMEOUT", "2.5", 1);
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--log-level", "debug"), 0);
    ck_assert_str_eq(cfg.model, "/m/demo");
    ck_assert_int_eq(cfg.max_queue, 5);
    ck_assert(cfg.log.json);
    ck_assert_double_eq(cfg.drain_timeout_s, 2.5);
    ck_assert_int_eq(cfg.log.level, DIT_LOG_DEBUG);
    ck_assert_int_eq(PARSE(&cfg, "--max-queue", "7", "--model", "/m/other", "--drain-timeout", "9"),
                     0);
    ck_assert_int_eq(cfg.max_queue, 7);
    ck_assert_str_eq(cfg.model, "/m/other");
    ck_assert_double_eq(cfg.drain_timeout_s, 9);
    setenv("DITD_LOG_JSON", "0", 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x"), 0);
    ck_assert(!cfg.log.json);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--log-json"), 0);
    ck_assert(cfg.log.json);
    clear_env();
}
END_TEST

START_TEST(bad_environment_value_names_the_variable)
{
    clear_env();
    setenv("DITD_MAX_QUEUE", "lots", 1);
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--model", "x"), 2);
    ck_assert_msg(strstr(err, "DITD_MAX_QUEUE wants an integer from 1 to 100000, not 'lots'"), "%s",
                  err);
    /* A flag's value does not rescue a bad variable: the variable is wrong. */
    setenv("DITD_MAX_QUEUE", "-1", 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x"), 2);
    ck_assert_msg(strstr(err, "DITD_MAX_QUEUE"), "%s", err);
    clear_env();
    setenv("DITD_LOG_JSON", "maybe", 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x"), 2);
    ck_assert_msg(strstr(err, "DITD_LOG_JSON wants 1/0, true/false or yes/no, not 'maybe'"), "%s",
                  err);
    clear_env();
}
END_TEST

START_TEST(bad_flag_values_say_what_is_wanted)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--max-queue", "12x"), 2);
    ck_assert_msg(strstr(err, "ditd: --max-queue wants an integer from 1 to 100000, not '12x'"),
                  "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--drain-timeout", "0"), 2);
    ck_assert_msg(strstr(err, "--drain-timeout wants a positive number of seconds, not '0'"), "%s",
                  err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--metrics-port", "70000"), 2);
    ck_assert_msg(strstr(err, "--metrics-port wants an integer from -1 to 65535"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--listen", "127.0.0.1:99999"), 2);
    ck_assert_msg(strstr(err, "the port is not a number from 0 to 65535"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--backend", "tpu"), 2);
    ck_assert_msg(strstr(err, "unknown backend 'tpu'"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--log-level", "loud"), 2);
    ck_assert_msg(strstr(err, "log level 'loud'"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--max-queue"), 2);
    ck_assert_msg(strstr(err, "option '--max-queue' needs a value"), "%s", err);
    /* A request must fit one worker message (512 MiB) with room to spare. */
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--max-message-bytes", "268435456"), 0);
    ck_assert_int_eq(cfg.max_message_bytes, 256ll << 20);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--max-message-bytes", "536870912"), 2);
    ck_assert_msg(strstr(err, "--max-message-bytes wants an integer from 1024 to 268435456"), "%s",
                  err);
}
END_TEST

START_TEST(usage_mistakes)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--max-queue", "3"), 2);
    ck_assert_msg(strstr(err, "--model (or DITD_MODEL) is required"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--max-qeue", "3"), 2);
    ck_assert_msg(strstr(err, "unknown option '--max-qeue'; did you mean '--max-queue'?"), "%s",
                  err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "stray"), 2);
    ck_assert_msg(strstr(err, "unexpected argument 'stray'"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--tls-cert", "c.pem"), 2);
    ck_assert_msg(strstr(err, "--tls-cert and --tls-key go together"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--ring", "2", "--local-ranks", "1"), 2);
    ck_assert_msg(strstr(err, "give --join-listen IP:PORT and --join-secret-file FILE"), "%s", err);
}
END_TEST

START_TEST(listen_forms)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--listen", ":7000"), 0);
    ck_assert_str_eq(cfg.listen, "0.0.0.0:7000");
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--listen", "[::1]:0"), 0);
    ck_assert_str_eq(cfg.listen, "[::1]:0");
    setenv("DITD_LISTEN", "::1:5", 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x"), 2);
    ck_assert_msg(strstr(err, "an IPv6 address goes in brackets"), "%s", err);
    clear_env();
}
END_TEST

START_TEST(http_listen_forms_and_limits)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-listen", ":8080"), 0);
    ck_assert_str_eq(cfg.http_listen, "0.0.0.0:8080");
    ck_assert_str_eq(cfg.listen, "0.0.0.0:50051");
    setenv("DITD_HTTP_LISTEN", "127.0.0.1:0", 1);
    setenv("DITD_HTTP_CORS_ORIGINS", "https://a.example,https://b.example", 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-max-body-bytes", "65536",
                           "--http-max-connections", "32", "--http-idle-timeout", "5"),
                     0);
    ck_assert_str_eq(cfg.http_listen, "127.0.0.1:0");
    ck_assert_str_eq(cfg.http_cors_origins, "https://a.example,https://b.example");
    ck_assert_int_eq(cfg.http_max_body_bytes, 64 << 10);
    ck_assert_int_eq(cfg.http_max_connections, 32);
    ck_assert_double_eq(cfg.http_idle_timeout_s, 5);
    unsetenv("DITD_HTTP_LISTEN");
    unsetenv("DITD_HTTP_CORS_ORIGINS");
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-listen", "8080"), 2);
    ck_assert_msg(strstr(err, "--http-listen '8080': it has no ':PORT'"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-listen", ":99999"), 2);
    ck_assert_msg(strstr(err, "--http-listen"), "%s", err);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-max-body-bytes", "128"), 2);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-max-connections", "0"), 2);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-video-jobs", "8", "--http-video-bytes",
                           "4194304", "--http-video-retention", "2.5"),
                     0);
    ck_assert_int_eq(cfg.http_video_jobs, 8);
    ck_assert_int_eq(cfg.http_video_bytes, 4 << 20);
    ck_assert_double_eq(cfg.http_video_retention_s, 2.5);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-video-jobs", "0"), 2);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-video-retention", "0"), 2);
    /* The TLS flags are gRPC's and HTTP's alike. */
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--http-listen", ":8080", "--tls-cert", "c",
                           "--tls-key", "k", "--tls-client-ca", "ca"),
                     0);
    ck_assert_str_eq(cfg.tls_client_ca, "ca");
}
END_TEST

START_TEST(parallel_layout_from_flags)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(
        PARSE(&cfg, "--model", "x", "--ring", "2", "--ulysses", "2", "--no-fp32-merge"), 0);
    ck_assert_int_eq(cfg.pc.world_size, 4);
    ck_assert_int_eq(cfg.pc.ring_degree, 2);
    ck_assert_int_eq(cfg.pc.ulysses_degree, 2);
    ck_assert(!cfg.pc.fp32_merge);
    ck_assert_int_eq(cfg.local_ranks, 4);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--ring", "2", "--world-size", "3"), 2);
    ck_assert_msg(err[0] != '\0', "a world size that is not R x U x T is refused");
    /* --cfg-parallel doubles the default world; an explicit one must be
     * 2 x R x U x T. */
    ck_assert_int_eq(cfg.pc.cfg_degree, 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--cfg-parallel", "--ring", "2"), 0);
    ck_assert_int_eq(cfg.pc.cfg_degree, 2);
    ck_assert_int_eq(cfg.pc.world_size, 4);
    ck_assert_int_eq(cfg.local_ranks, 4);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--cfg-parallel", "--world-size", "2"), 0);
    ck_assert_int_eq(cfg.pc.world_size, 2);
    ck_assert_int_eq(
        PARSE(&cfg, "--model", "x", "--cfg-parallel", "--ring", "2", "--world-size", "2"), 2);
    ck_assert_msg(strstr(err, "cfg_degree (2) x ring_degree (2) x ulysses_degree (1) x tp_degree "
                              "(1) = 4 must equal the world size (2)"),
                  "%s", err);
    setenv("DITD_CFG_PARALLEL", "1", 1);
    ck_assert_int_eq(PARSE(&cfg, "--model", "x", "--tp", "2"), 0);
    unsetenv("DITD_CFG_PARALLEL");
    ck_assert_int_eq(cfg.pc.cfg_degree, 2);
    ck_assert_int_eq(cfg.pc.world_size, 4);
}
END_TEST

START_TEST(warmup_shapes)
{
    int w = -1, h = -1, f = -1, s = -1;
    ck_assert_int_eq(dit_warmup_spec_parse("256x128:2", &w, &h, &f, &s), 0);
    ck_assert(w == 256 && h == 128 && f == 0 && s == 2);
    ck_assert_int_eq(dit_warmup_spec_parse("832x480x81:1", &w, &h, &f, &s), 0);
    ck_assert(w == 832 && h == 480 && f == 81 && s == 1);
    const char *bad[] = {"",          "256x256",   "256x256:",  "256x256:2x", "0x256:2",
                         "256x256:0", "256x-1:2",  "8x8x0:1",   "8x8x-5:1",   "8x8x9",
                         "8x8x9:1:",  "a x b : c", "256x256:2 "};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        ck_assert_msg(dit_warmup_spec_parse(bad[i], &w, &h, &f, &s) == -1, "'%s' was accepted",
                      bad[i]);
}
END_TEST

START_TEST(lora_flags)
{
    clear_env();
    static dit_daemon_config cfg;
    /* Repeated and comma-separated NAME=PATH; PATHs must be readable. */
    const char *ok[] = {"--model",
                        "m",
                        "--lora",
                        "a=/dev/null,b.v2-x_y=/dev/null",
                        "--lora",
                        "c=/dev/null",
                        "--lora-dir",
                        "/tmp",
                        "--lora-cache-bytes",
                        "1000",
                        NULL};
    ck_assert_int_eq(parse(&cfg, out, sizeof out, err, sizeof err, ok), 0);
    ck_assert_int_eq(cfg.n_preload_loras, 3);
    ck_assert_str_eq(cfg.preload_loras[1].name, "b.v2-x_y");
    ck_assert_str_eq(cfg.preload_loras[2].path, "/dev/null");
    ck_assert_str_eq(cfg.lora_dir, "/tmp");
    ck_assert_int_eq(cfg.lora_cache_bytes, 1000);
    const char *none[] = {"--model", "m", NULL};
    ck_assert_int_eq(parse(&cfg, out, sizeof out, err, sizeof err, none), 0);
    ck_assert(cfg.n_preload_loras == 0 && !cfg.lora_dir);
    /* DITD_LORA alone, and a --lora flag, which replaces it (the flag wins)
     * rather than adding to it: the same name in both is no clash. */
    setenv("DITD_LORA", "a=/dev/null,e=/dev/null", 1);
    ck_assert_int_eq(parse(&cfg, out, sizeof out, err, sizeof err, none), 0);
    ck_assert_int_eq(cfg.n_preload_loras, 2);
    const char *flag_b[] = {"--model", "m", "--lora", "b=/dev/null", NULL};
    ck_assert_int_eq(parse(&cfg, out, sizeof out, err, sizeof err, flag_b), 0);
    ck_assert_int_eq(cfg.n_preload_loras, 1);
    ck_assert_str_eq(cfg.preload_loras[0].name, "b");
    const char *flag_a2[] = {"--model", "m",           "--lora", "a=/dev/null",
                             "--lora",  "c=/dev/null", NULL};
    ck_assert_int_eq(parse(&cfg, out, sizeof out, err, sizeof err, flag_a2), 0);
    ck_assert_int_eq(cfg.n_preload_loras, 2);
    ck_assert_str_eq(cfg.preload_loras[0].name, "a");
    ck_assert_str_eq(cfg.preload_loras[1].name, "c");
    unsetenv("DITD_LORA");
    ck_assert_int_eq(cfg.lora_cache_bytes, 2147483648ll);
    struct {
        const char *flag, *value, *needle;
    } bad[] = {
        {"--lora", "../x=/dev/null", "'../x'"},
        {"--lora", "a/b=/dev/null", "'a/b'"},
        {"--lora", "x..y=/dev/null", "'x..y'"},
        {"--lora", "=/dev/null", "NAME=PATH"},
        {"--lora", "a=", "NAME=PATH"},
        {"--lora", "a", "NAME=PATH"},
        {"--lora", "a=/dev/null,a=/dev/null", "names 'a' twice"},
        {"--lora", "a=/nonexistent/x.safetensors", "/nonexistent/x.safetensors"},
        {"--lora-dir", "/nonexistent", "not a directory"},
        {"--lora-dir", "/dev/null", "not a directory"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *args[] = {"--model", "m", bad[i].flag, bad[i].value, NULL};
        ck_assert_int_eq(parse(&cfg, out, sizeof out, err, sizeof err, args), 2);
        ck_assert_msg(strstr(err, bad[i].needle), "%s %s: %s", bad[i].flag, bad[i].value, err);
    }
}
END_TEST

START_TEST(help_lists_every_flag_with_its_variable_and_default)
{
    clear_env();
    dit_daemon_config cfg;
    ck_assert_int_eq(PARSE(&cfg, "--help"), 1);
    const char *want[] = {"--model DIR",
                          "DITD_MODEL",
                          "--max-queue N",
                          "DITD_MAX_QUEUE",
                          "16",
                          "--drain-timeout SECONDS",
                          "30",
                          "--log-json",
                          "DITD_LOG_JSON",
                          "--join-secret-file FILE",
                          "--metrics-port PORT",
                          "--cfg-parallel",
                          "DITD_CFG_PARALLEL",
                          "--help",
                          "--version",
                          "SIGTERM"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(strstr(out, want[i]), "--help lacks '%s':\n%s", want[i], out);
    ck_assert_int_eq(PARSE(&cfg, "--version"), 1);
    ck_assert_msg(strncmp(out, "ditd ", 5) == 0, "%s", out);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon_config");
    TCase *tc = tcase_create("table");
    tcase_add_test(tc, defaults_come_from_the_table);
    tcase_add_test(tc, model_name_is_the_folder_name);
    tcase_add_test(tc, environment_sets_and_flags_win);
    tcase_add_test(tc, bad_environment_value_names_the_variable);
    tcase_add_test(tc, bad_flag_values_say_what_is_wanted);
    tcase_add_test(tc, usage_mistakes);
    tcase_add_test(tc, listen_forms);
    tcase_add_test(tc, http_listen_forms_and_limits);
    tcase_add_test(tc, parallel_layout_from_flags);
    tcase_add_test(tc, warmup_shapes);
    tcase_add_test(tc, lora_flags);
    tcase_add_test(tc, help_lists_every_flag_with_its_variable_and_default);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
