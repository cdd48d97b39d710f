/* session 13, third part: 4-bit row-kernel variants (A before, B 7 shifts, C offset loads, D 8 accumulators, G two rows,
   R a plain read), K N nmat reps: gcc -O3 -march=native -ffp-contract=off [-DPF=4096] s13c_gemv4_mb.c -o mb; ./mb 896 4864 100 5 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifndef PF
#define PF 4096
#endif
#define T "avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512fp16,avx512vbmi"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* A: current: 32 cols per step */
__attribute__((target(T))) float rowA(const uint8_t*c,const float*x,long nb,__m512 tab){
  __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
  for(long b=0;b+1<nb;b+=2){
    const uint8_t*p=c+b*16; if(!(b&3))_mm_prefetch((const char*)p+PF,_MM_HINT_T0);
    __m512i v=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    a0=_mm512_fmadd_ps(_mm512_permutexvar_ps(v,tab),_mm512_loadu_ps(x+b*32),a0);
    a1=_mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v,4),tab),_mm512_loadu_ps(x+b*32+16),a1);
    v=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p+16)));
    a2=_mm512_fmadd_ps(_mm512_permutexvar_ps(v,tab),_mm512_loadu_ps(x+b*32+32),a2);
    a3=_mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v,4),tab),_mm512_loadu_ps(x+b*32+48),a3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));
}
/* B: 128 cols per step, shifts */
#define L(V,S,A) A=_mm512_fmadd_ps(_mm512_permutexvar_ps(V,tab),_mm512_loadu_ps(xb+16*(S)),A)
__attribute__((target(T))) float rowB(const uint8_t*c,const float*x,long nb,__m512 tab){
  __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
  for(long b=0;b<nb;b++){
    const uint8_t*p=c+b*64; _mm_prefetch((const char*)p+PF,_MM_HINT_T0);
    const float*xb=x+b*128;
    __m512i v=_mm512_loadu_si512(p);
    L(v,0,a0); L(_mm512_srli_epi32(v,4),1,a1); L(_mm512_srli_epi32(v,8),2,a2); L(_mm512_srli_epi32(v,12),3,a3);
    L(_mm512_srli_epi32(v,16),4,a0); L(_mm512_srli_epi32(v,20),5,a1); L(_mm512_srli_epi32(v,24),6,a2); L(_mm512_srli_epi32(v,28),7,a3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));
}
/* C: offset loads + 4 shifts */
__attribute__((target(T))) float rowC(const uint8_t*c,const float*x,long nb,__m512 tab){
  __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
  for(long b=0;b<nb;b++){
    const uint8_t*p=c+b*64; _mm_prefetch((const char*)p+PF,_MM_HINT_T0);
    const float*xb=x+b*128;
    __m512i v0=_mm512_loadu_si512(p),v1=_mm512_loadu_si512(p+1),v2=_mm512_loadu_si512(p+2),v3=_mm512_loadu_si512(p+3);
    L(v0,0,a0); L(_mm512_srli_epi32(v0,4),1,a1); L(v1,2,a2); L(_mm512_srli_epi32(v1,4),3,a3);
    L(v2,4,a0); L(_mm512_srli_epi32(v2,4),5,a1); L(v3,6,a2); L(_mm512_srli_epi32(v3,4),7,a3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));
}
/* D: C with 8 accumulators */
__attribute__((target(T))) float rowD(const uint8_t*c,const float*x,long nb,__m512 tab){
  __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0;
  for(long b=0;b<nb;b++){
    const uint8_t*p=c+b*64; _mm_prefetch((const char*)p+PF,_MM_HINT_T0);
    const float*xb=x+b*128;
    __m512i v0=_mm512_loadu_si512(p),v1=_mm512_loadu_si512(p+1),v2=_mm512_loadu_si512(p+2),v3=_mm512_loadu_si512(p+3);
    L(v0,0,a0); L(_mm512_srli_epi32(v0,4),1,a1); L(v1,2,a2); L(_mm512_srli_epi32(v1,4),3,a3);
    L(v2,4,a4); L(_mm512_srli_epi32(v2,4),5,a5); L(v3,6,a6); L(_mm512_srli_epi32(v3,4),7,a7);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)),_mm512_add_ps(_mm512_add_ps(a4,a5),_mm512_add_ps(a6,a7))));
}
__attribute__((target(T))) float rowR(const uint8_t*c,const float*x,long nb,__m512 tab){
  __m512i a0=_mm512_setzero_si512(),a1=a0;
  for(long b=0;b<nb;b++){ const uint8_t*p=c+b*64; 
#ifdef RPF
_mm_prefetch((const char*)p+PF,_MM_HINT_T0);
#endif
    if(b&1) a1=_mm512_add_epi32(a1,_mm512_loadu_si512(p)); else a0=_mm512_add_epi32(a0,_mm512_loadu_si512(p));}
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(a0,a1));
}
/* E: shifts by 8 of v0 and v0>>4 (2 base + 6 shifts... ) : v0, h=v0>>4, then v0>>8,h>>8,... same 7 shifts but shorter chains */
/* F: vpmultishift? skip. G: two rows interleaved (C) */
__attribute__((target(T))) void rowG(const uint8_t*c,const uint8_t*c2,const float*x,long nb,__m512 tab,__m512 tab2,float*o){
  __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0,b0=a0,b1=a0,b2=a0,b3=a0;
  for(long b=0;b<nb;b++){
    const uint8_t*p=c+b*64,*q=c2+b*64; _mm_prefetch((const char*)p+PF,_MM_HINT_T0);_mm_prefetch((const char*)q+PF,_MM_HINT_T0);
    const float*xb=x+b*128;
    __m512i v0=_mm512_loadu_si512(p),v1=_mm512_loadu_si512(p+1),v2=_mm512_loadu_si512(p+2),v3=_mm512_loadu_si512(p+3);
    L(v0,0,a0); L(_mm512_srli_epi32(v0,4),1,a1); L(v1,2,a2); L(_mm512_srli_epi32(v1,4),3,a3);
    L(v2,4,a0); L(_mm512_srli_epi32(v2,4),5,a1); L(v3,6,a2); L(_mm512_srli_epi32(v3,4),7,a3);
#define tab tab2
    v0=_mm512_loadu_si512(q),v1=_mm512_loadu_si512(q+1),v2=_mm512_loadu_si512(q+2),v3=_mm512_loadu_si512(q+3);
    L(v0,0,b0); L(_mm512_srli_epi32(v0,4),1,b1); L(v1,2,b2); L(_mm512_srli_epi32(v1,4),3,b3);
    L(v2,4,b0); L(_mm512_srli_epi32(v2,4),5,b1); L(v3,6,b2); L(_mm512_srli_epi32(v3,4),7,b3);
#undef tab
  }
  o[0]=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));
  o[1]=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0,b1),_mm512_add_ps(b2,b3)));
}
int main(int argc,char**argv){
  long K=atol(argv[1]),N=atol(argv[2]),nmat=atol(argv[3]),reps=atol(argv[4]);
  long rb=K/2, nb=K/128; size_t tot=(size_t)nmat*N*rb+64;
  uint8_t*codes=aligned_alloc(64,(tot+63)/64*64); for(size_t i=0;i<tot;i++)codes[i]=rand();
  float*x=aligned_alloc(64,K*4); for(long i=0;i<K;i++)x[i]=rand()/(float)RAND_MAX;
  uint16_t*cb=malloc(N*32); for(long i=0;i<N*16;i++){_Float16 h=(_Float16)(rand()/(float)RAND_MAX);memcpy(cb+i,&h,2);}
  float*y=malloc(N*4*2);
  const char*names="ABCDGR";
  for(int vi=0;vi<6;vi++){ double best=1e9;
    for(int r=0;r<reps;r++){ double t0=now();
      for(long m=0;m<nmat;m++){const uint8_t*cm=codes+(size_t)m*N*rb;
        if(vi==4){ for(long n=0;n+1<N;n+=2){__m512 t1=_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(cb+n*16))),t2=_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(cb+n*16+16)));rowG(cm+n*rb,cm+(n+1)*rb,x,nb,t1,t2,y+n);} }
        else for(long n=0;n<N;n++){__m512 t=_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(cb+n*16)));
          y[n]= vi==0?rowA(cm+n*rb,x,nb*4,t): vi==1?rowB(cm+n*rb,x,nb,t): vi==2?rowC(cm+n*rb,x,nb,t):vi==5?rowR(cm+n*rb,x,nb,t):rowD(cm+n*rb,x,nb,t);}
      }
      double dt=now()-t0; if(dt<best)best=dt;}
    printf("%c K=%ld N=%ld nmat=%ld: %.2f GB/s (y0=%g)\n",names[vi],K,N,nmat,(double)nmat*N*rb/best/1e9,y[0]);
  }
}
