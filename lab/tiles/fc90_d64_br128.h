/* lab: the dense d 64 Hopper forward on the two-consumer 128-row tile (the BMASK kernels' tile) instead of three
 * consumers' 192 rows: whether N % 192 tails (N 1024: a sixth tile of 64 rows) cost more than two consumers do */
#define FC90_TILE_64 fc90_tile{64, 128, 128, 2}
