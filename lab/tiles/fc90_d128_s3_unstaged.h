/* lab: the Hopper forward's d 128 tile with 3 stages of 128 keys in the shared memory the output staging leaves
 * (the output stored unstaged), on the persistent grid */
#define FC90_O_UNSTAGED 1
#define FC90_TILE_128 fc90_tile{128, 128, 128, 3}
