/*
 * cli.h - what the subcommands of the flashc command share: option parsing, number formats, timing, half
 * conversions, and host/device memory for the backend a command runs on.
 */
#ifndef FLASHC_TOOLS_CLI_H
#define FLASHC_TOOLS_CLI_H

#include "flashc.h"

#include <stddef.h>
#include <stdint.h>

/* Subcommands: each returns the process exit status (0 ok, 1 failure, 2 usage error). */
int cli_info(int argc, char **argv);
int cli_run(int argc, char **argv);
int cli_check(int argc, char **argv);
int cli_bench(int argc, char **argv);

/* ---- options ------------------------------------------------------------------------------------------------ */

/* argv[0] is the subcommand's name; argv[*i] is "--name", "--name=value" or something else. For a match, *val
 * is set from "=value" or from the next argument (advancing *i). Returns 1 on a match, 0 otherwise, -1 (after
 * printing why) when the value is missing. */
int cli_opt(int argc, char **argv, int *i, const char *name, const char **val);
/* 1 when argv[i] is exactly the flag --name. */
int cli_flag(const char *arg, const char *name);
/* 1 for -h, --help, help. */
int cli_is_help(const char *arg);

/* Strict parsers: the whole string must be a number (no blanks), in [lo, hi] for integers, for f32 a finite value
 * that fp32 holds as a normal number or exactly 0. Return 0 or -1 after printing why. */
int cli_parse_i64(const char *cmd, const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out);
int cli_parse_f32(const char *cmd, const char *opt, const char *s, float *out);
int cli_parse_backend(const char *cmd, const char *s, flashc_backend *out);
int cli_parse_dtype(const char *cmd, const char *s, flashc_dtype *out);

/* 1 when the two paths name one file: the same (device, inode) through any spelling, symbolic or hard link;
 * for names that do not exist yet, the same final name in the same directory. */
int cli_same_file(const char *a, const char *b);

/* Prints "flashc CMD: message" and a pointer to --help on stderr; returns 2. */
int cli_usage_error(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Prints "flashc CMD: message" on stderr; returns 1. */
int cli_fail(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---- formatting, time, numbers -------------------------------------------------------------------------------- */

/* "512 B", "96.0 KiB", "1.50 GiB" into buf. */
const char *cli_bytes(double bytes, char *buf, size_t len);
/* Monotonic seconds. */
double cli_now(void);
/* Threads OpenMP would use by default (1 when the command was built without OpenMP). */
int cli_omp_max_threads(void);

float cli_f16_to_f32(uint16_t h);
uint16_t cli_f32_to_f16(float f);
float cli_bf16_to_f32(uint16_t b);
uint16_t cli_f32_to_bf16(float f);
/* Element i of a host array of dtype, as float. */
float cli_load(const void *data, flashc_dtype dtype, size_t i);
void cli_store(void *data, flashc_dtype dtype, size_t i, float x);
size_t cli_dtype_size(flashc_dtype dtype);

/* ---- backends and their memory (device.c) --------------------------------------------------------------------- */

/* 1 when this command can move data to and from CUDA memory (built with FLASHC_WITH_CUDA). */
int cli_cuda_runtime(void);
/* AUTO resolves to CUDA only when the library has it, a GPU is present and this command can copy to it. */
flashc_backend cli_resolve_backend(flashc_backend requested);
/* Checks that the command can drive backend b (compiled in, device present, runtime available); prints why
 * not and returns -1. */
int cli_backend_usable(const char *cmd, flashc_backend b, int device);

/* Memory where backend b computes. alloc returns NULL on failure; copies return 0 or -1. */
void *cli_mem_alloc(flashc_backend b, size_t bytes);
void cli_mem_free(flashc_backend b, void *ptr);
int cli_mem_to_backend(flashc_backend b, void *dst, const void *src, size_t bytes);
int cli_mem_to_host(flashc_backend b, void *dst, const void *src, size_t bytes);
/* Selects the device for the runtime calls above (CUDA); no-op on the CPU. */
int cli_set_device(flashc_backend b, int device);
/* Installs the testkit memory hooks that match backend b (flashc check). */
void cli_case_memory(flashc_backend b);

/* A timer around work submitted to backend b: CUDA events on the default stream, else the wall clock. */
typedef struct cli_timer cli_timer;
cli_timer *cli_timer_create(flashc_backend b);
void cli_timer_start(cli_timer *t);
/* Waits for the work and returns the seconds since cli_timer_start, or a negative value on a device error. */
double cli_timer_stop(cli_timer *t);
void cli_timer_destroy(cli_timer *t);

#endif /* FLASHC_TOOLS_CLI_H */
