/*
 * npy.h - reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0) for the flashc command.
 *
 * Only what attention needs: C-ordered, little-endian '<f4' (float32), '<f2' (float16) and '<u2', which
 * flashc reads as bfloat16 bits because NumPy has no bfloat16 of its own. Every failure returns -1 with a
 * message that starts with the file's name, so the command can print it as is.
 */
#ifndef FLASHC_TOOLS_NPY_H
#define FLASHC_TOOLS_NPY_H

#include "flashc.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* NumPy allows up to 64 dimensions; anything past 32 is refused as a malformed header. */
#define NPY_MAX_NDIM 32

typedef struct npy_array {
    flashc_dtype dtype;
    int ndim;
    int64_t shape[NPY_MAX_NDIM];
    size_t count; /* elements: the product of shape (1 for a 0-d array) */
    void *data;   /* count elements of dtype, host byte order; owned, release with npy_free */
} npy_array;

/* The .npy descr written for a dtype: "<f4", "<f2" or "<u2". */
const char *npy_descr(flashc_dtype dtype);

/* Reads a whole .npy file. On failure *a is left empty and err holds "name: why". */
int npy_read(const char *path, npy_array *a, char *err, size_t errlen);
/* Same from an open stream positioned at the magic; name is used in messages only. */
int npy_read_stream(FILE *f, const char *name, npy_array *a, char *err, size_t errlen);

/* An output file on its way to disk (the rules are at the top of npy.c's writing section): a regular file is
 * written to a temporary beside it and renamed over it by npy_out_commit; a device or FIFO is written straight
 * through (direct). Neither path ever removes the named file. */
typedef struct npy_out {
    const char *name; /* as given, for messages */
    char *target;     /* name with symbolic links followed: what gets replaced */
    char *tmp;        /* the temporary; NULL when direct, or once renamed */
    FILE *f;
    int direct;
} npy_out;

/* Checks the name and opens the temporary (or the device). On failure nothing exists that did not before. */
int npy_out_open(npy_out *o, const char *path, char *err, size_t errlen);
/* Writes the array, flushes, syncs and closes. On failure call npy_out_discard. */
int npy_out_write(npy_out *o, flashc_dtype dtype, int ndim, const int64_t *shape, const void *data, char *err,
                  size_t errlen);
/* For text written to o->f by the caller: checks the stream, flushes, syncs and closes. On failure call
 * npy_out_discard. */
int npy_out_close(npy_out *o, char *err, size_t errlen);
/* Renames the temporary over the name; releases o either way. */
int npy_out_commit(npy_out *o, char *err, size_t errlen);
/* Removes the temporary, if any, and releases o; safe on a zeroed or released npy_out. */
void npy_out_discard(npy_out *o);

/* Writes a C-ordered array of ndim dimensions (0..NPY_MAX_NDIM) through npy_out: all or nothing. */
int npy_write(const char *path, flashc_dtype dtype, int ndim, const int64_t *shape, const void *data,
              char *err, size_t errlen);
int npy_write_stream(FILE *f, const char *name, flashc_dtype dtype, int ndim, const int64_t *shape,
                     const void *data, char *err, size_t errlen);

void npy_free(npy_array *a);

#endif /* FLASHC_TOOLS_NPY_H */
