/* lab: d128 with 64-key tiles, 3 stages (139 KB: 1 block per SM) */
#define FC_TILE_128_SM90 fc_tile{128, 128, 64, 4, 3, 0, 2}
