#ifndef FLUXION_H
#define FLUXION_H
int fx_version(void);
#endif
