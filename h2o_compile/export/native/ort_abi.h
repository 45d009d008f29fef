// The part of ONNX Runtime's C ABI this library uses, declared here (the onnxruntime wheels ship no headers).
//
// Why this is enough: a custom-op library never links libonnxruntime. ONNX Runtime dlopens it and calls
// RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*); OrtApiBase::GetApi(version) returns the OrtApi
// table, a struct of function pointers that only ever grows at its end, so an entry's position (its index
// in pointer-sized slots) and its signature are fixed by the published C API once they appear. We name the
// slots we call at their published positions and fill the others with placeholders; the static_asserts
// below pin each position, so an edit that shifts a slot fails to compile instead of calling the wrong
// function. OrtCustomOp is the struct *we* fill; ONNX Runtime reads only the fields that exist at the
// `version` we put in it.
//
// Pinned to API version 16 (onnxruntime 1.16): the first version whose OrtCustomOp has CreateKernelV2 /
// KernelComputeV2, which return an OrtStatus*, so a bad input becomes an ONNX Runtime error (a Python
// exception) instead of a C++ exception thrown across the C boundary. A library built for version N runs
// on any runtime >= N (GetApi(N) returns NULL on an older one, which RegisterCustomOps reports).
#pragma once
#include <cstddef>
#include <cstdint>

#define H2O_ORT_API_VERSION 16u

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtTensorTypeAndShapeInfo;

// Element types (ONNX TensorProto.DataType numbering).
enum OrtElemType : int {
  kOrtUndefined = 0, kOrtFloat = 1, kOrtInt32 = 6, kOrtInt64 = 7, kOrtBool = 9, kOrtFloat16 = 10,
  kOrtDouble = 11, kOrtBFloat16 = 16,
};
enum OrtErrorCodeValue : int { kOrtOk = 0, kOrtFail = 1, kOrtInvalidArgument = 2 };
enum OrtCharacteristic : int { kOrtRequired = 0, kOrtOptional = 1, kOrtVariadic = 2 };
enum OrtMemTypeValue : int { kOrtMemTypeDefault = 0 };

struct OrtApi {
  OrtStatus* (*CreateStatus)(int code, const char* msg);                                   // 0
  void* slot1_GetErrorCode;                                                                // 1
  const char* (*GetErrorMessage)(const OrtStatus* status);                                 // 2
  void* slots3_25[23];                                                                     // 3..25
  OrtStatus* (*CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);         // 26
  OrtStatus* (*CustomOpDomain_Add)(OrtCustomOpDomain* domain, const struct OrtCustomOp* op);  // 27
  OrtStatus* (*AddCustomOpDomain)(OrtSessionOptions* options, OrtCustomOpDomain* domain);  // 28
  void* slots29_50[22];                                                                    // 29..50
  OrtStatus* (*GetTensorMutableData)(OrtValue* value, void** out);                         // 51
  void* slots52_59[8];                                                                     // 52..59
  OrtStatus* (*GetTensorElementType)(const OrtTensorTypeAndShapeInfo* info, int* out);     // 60
  OrtStatus* (*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out);    // 61
  OrtStatus* (*GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n);  // 62
  void* slots63_64[2];                                                                     // 63..64
  OrtStatus* (*GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);  // 65
  void* slots66_84[19];                                                                    // 66..84
  OrtStatus* (*KernelInfoGetAttribute_float)(const OrtKernelInfo* info, const char* name, float* out);  // 85
  OrtStatus* (*KernelInfoGetAttribute_int64)(const OrtKernelInfo* info, const char* name, int64_t* out);  // 86
  void* slot87_KernelInfoGetAttribute_string;                                              // 87
  OrtStatus* (*KernelContext_GetInputCount)(const OrtKernelContext* context, size_t* out);   // 88
  OrtStatus* (*KernelContext_GetOutputCount)(const OrtKernelContext* context, size_t* out);  // 89
  OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext* context, size_t index, const OrtValue** out);  // 90
  OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext* context, size_t index, const int64_t* dims,
                                        size_t dim_count, OrtValue** out);                 // 91
  void* slot92_ReleaseEnv;                                                                 // 92
  void (*ReleaseStatus)(OrtStatus* status);                                                // 93
  void* slots94_98[5];                                                                     // 94..98
  void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* info);                  // 99
  void* slots100_192[93];                                                                  // 100..192
  OrtStatus* (*KernelContext_GetGPUComputeStream)(const OrtKernelContext* context, void** out);  // 193
  // Later slots are never touched: the struct may be shorter than the runtime's table.
};

#define H2O_SLOT(field, index) static_assert(offsetof(OrtApi, field) == (index) * sizeof(void*), #field)
H2O_SLOT(CreateStatus, 0);
H2O_SLOT(GetErrorMessage, 2);
H2O_SLOT(CreateCustomOpDomain, 26);
H2O_SLOT(CustomOpDomain_Add, 27);
H2O_SLOT(AddCustomOpDomain, 28);
H2O_SLOT(GetTensorMutableData, 51);
H2O_SLOT(GetTensorElementType, 60);
H2O_SLOT(GetDimensionsCount, 61);
H2O_SLOT(GetDimensions, 62);
H2O_SLOT(GetTensorTypeAndShape, 65);
H2O_SLOT(KernelInfoGetAttribute_float, 85);
H2O_SLOT(KernelInfoGetAttribute_int64, 86);
H2O_SLOT(KernelContext_GetInputCount, 88);
H2O_SLOT(KernelContext_GetOutputCount, 89);
H2O_SLOT(KernelContext_GetInput, 90);
H2O_SLOT(KernelContext_GetOutput, 91);
H2O_SLOT(ReleaseStatus, 93);
H2O_SLOT(ReleaseTensorTypeAndShapeInfo, 99);
H2O_SLOT(KernelContext_GetGPUComputeStream, 193);  // the CUDA library only (since API 10, after HasValue)

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
};

// The custom op as ONNX Runtime reads it at version 16 (fields were appended: 1..7 the first ten,
// 8 the characteristics, 13 the input memory type, 14 the variadic arities, 16 the V2 callbacks).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
};
static_assert(offsetof(OrtCustomOp, CreateKernel) == sizeof(void*), "OrtCustomOp layout");
static_assert(offsetof(OrtCustomOp, KernelComputeV2) == 18 * sizeof(void*), "OrtCustomOp layout");

}  // extern "C"
