/* lab: block masks at d 64 on the three-consumer 192-row Hopper tile, as before the two-consumer BMASK tile (LOG.md,
 * twelfth session); lost to it on 128 x 128 blocks */
/* (the narrow tile's macro, which since also sets the tile of short causal d 64 problems) */
#define FC90_TILE_64_NARROW fc90_tile{64, 192, 128, 2}
