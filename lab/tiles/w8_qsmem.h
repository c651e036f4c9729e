/* lab: d128 with 8 warps of one m16 tile, Q re-read from shared memory, bc 64 */
#define FC_TILE_128_SM90 fc_tile{128, 128, 64, 8, 2, 0, 1}
