#include "fluxion.h"
int fx_version(void) { return 1; }
