/* lab: d64 with 128-key tiles, Q re-read from shared memory (spills 16 bytes on sm_90a: not shippable as is) */
#define FC_TILE_64_SM90 fc_tile{64, 128, 128, 4, 2, 0, 2}
