/* Rows unpadded (pitch = D): the LDGSTS of every row 32-byte aligned in shared memory, ldmatrix with bank conflicts */
#define FC_SMEM_PAD 0
