/* Rows padded by 32 bytes: every row 32-byte aligned in shared memory, ldmatrix 2-way conflicts */
#define FC_SMEM_PAD 16
