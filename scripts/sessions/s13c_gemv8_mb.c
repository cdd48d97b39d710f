/* session 13, third part: the 8-bit byte-plane kernel, extracts (default) or -DSTORE (store and reload):
   gcc -O3 -march=native -ffp-contract=off [-DSTORE] s13c_gemv8_mb.c -o mb8; ./mb8 896 4864 40 4 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define PF 4096
#define T "avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512fp16,avx512vbmi"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target(T))) float rowA(const uint8_t*c,const float*xx,long nb,const __m512i*lb,const __m512i*hb){
  __m512 a[4]; a[0]=a[1]=a[2]=a[3]=_mm512_setzero_ps();
  for(long b=0;b<nb;b++){ const uint8_t*p=c+b*64; _mm_prefetch((const char*)p+PF,_MM_HINT_T0);
    const __m512i v=_mm512_loadu_si512(p); const __mmask64 k7=_mm512_movepi8_mask(v);
    const __m512i lo=_mm512_mask_blend_epi8(k7,_mm512_permutex2var_epi8(lb[0],v,lb[1]),_mm512_permutex2var_epi8(lb[2],v,lb[3]));
    const __m512i hi=_mm512_mask_blend_epi8(k7,_mm512_permutex2var_epi8(hb[0],v,hb[1]),_mm512_permutex2var_epi8(hb[2],v,hb[3]));
    const __m512i w0=_mm512_unpacklo_epi8(lo,hi),w1=_mm512_unpackhi_epi8(lo,hi);
    const float*x=xx+b*64;
#ifdef STORE
    __m512i buf[2]; _mm512_store_si512(buf,w0); _mm512_store_si512(buf+1,w1);
    const __m256i*hp=(const __m256i*)buf;
    a[0]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w0)),_mm512_loadu_ps(x),a[0]);
    a[1]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_load_si256(hp+1)),_mm512_loadu_ps(x+16),a[1]);
    a[2]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w1)),_mm512_loadu_ps(x+32),a[2]);
    a[3]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_load_si256(hp+3)),_mm512_loadu_ps(x+48),a[3]);
#else
    a[0]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w0)),_mm512_loadu_ps(x),a[0]);
    a[1]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w0,1)),_mm512_loadu_ps(x+16),a[1]);
    a[2]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w1)),_mm512_loadu_ps(x+32),a[2]);
    a[3]=_mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w1,1)),_mm512_loadu_ps(x+48),a[3]);
#endif
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0],a[1]),_mm512_add_ps(a[2],a[3])));
}
int main(int argc,char**argv){
  long K=atol(argv[1]),N=atol(argv[2]),nmat=atol(argv[3]),reps=atol(argv[4]);
  long rb=K, nb=K/64; size_t tot=(size_t)nmat*N*rb+64;
  uint8_t*codes=aligned_alloc(64,(tot+63)/64*64); for(size_t i=0;i<tot;i++)codes[i]=rand();
  float*x=aligned_alloc(64,K*4); for(long i=0;i<K;i++)x[i]=rand()/(float)RAND_MAX;
  __m512i lb[4],hb[4]; for(int i=0;i<4;i++){lb[i]=_mm512_set1_epi8(i+1);hb[i]=_mm512_set1_epi8(0x3c);}
  float*y=malloc(N*4); double best=1e9;
  for(int r=0;r<reps;r++){double t0=now();
    for(long m=0;m<nmat;m++)for(long n=0;n<N;n++)y[n]=rowA(codes+((size_t)m*N+n)*rb,x,nb,lb,hb);
    double dt=now()-t0; if(dt<best)best=dt;}
  printf("K=%ld N=%ld nmat=%ld: %.2f GB/s (%g)\n",K,N,nmat,(double)nmat*N*rb/best/1e9,y[0]);
}
