// Loads the plugin library on CPU (no CUDA call happens before enqueue) and prints what TensorRT
// would see: creators, attributes, outputs, aliases, dtypes, workspace. tests/test_plugins.py
// compares it with dflash_trt/kernels/plugin_spec.py.
#include <NvInferRuntime.h>

#include <cstdio>
#include <cstring>

using namespace nvinfer1;

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

int main()
{
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    for (int32_t c = 0; c < n; ++c)
    {
        auto* creator = static_cast<IPluginCreatorV3One*>(creators[c]);
        std::printf("plugin %s %s %s\n", creator->getPluginName(), creator->getPluginNamespace(), creator->getPluginVersion());
        PluginFieldCollection const* fields = creator->getFieldNames();
        for (int32_t f = 0; f < fields->nbFields; ++f)
        {
            PluginField const& field = fields->fields[f];
            bool isInt = field.type == PluginFieldType::kINT32;
            double value = isInt ? *static_cast<int32_t const*>(field.data) : *static_cast<float const*>(field.data);
            std::printf("field %s %s %g\n", field.name, isInt ? "int32" : "float32", value);
        }
        // create with one attribute changed, then read it back as TensorRT serializes it
        int32_t seven = 7;
        PluginField changed(fields->fields[0].name, &seven, PluginFieldType::kINT32, 1);
        PluginFieldCollection fc{1, &changed};
        IPluginV3* plugin = creator->createPlugin("probe", &fc, TensorRTPhase::kBUILD);
        auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        PluginFieldCollection const* saved = runtime->getFieldsToSerialize();
        std::printf("serialized %s %d\n", saved->fields[0].name, *static_cast<int32_t const*>(saved->fields[0].data));
        auto* build = static_cast<IPluginV3OneBuildV2*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
        int32_t outs = build->getNbOutputs();
        std::printf("outputs %d\n", outs);
        for (int32_t o = 0; o < outs; ++o)
        {
            std::printf("alias %d %d\n", o, build->getAliasedInput(o));
        }
        DataType in[7] = {DataType::kBF16, DataType::kFP8, DataType::kFP8, DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32};
        DataType out[3];
        int32_t nbIn = std::strcmp(creator->getPluginName(), "DFlashAccept") == 0 ? 4 : 7;
        if (std::strcmp(creator->getPluginName(), "DFlashKVInject") == 0)
        {
            in[5] = in[6] = DataType::kFP8;
        }
        if (build->getOutputDataTypes(out, outs, in, nbIn) == 0)
        {
            std::printf("out_dtype0 %d\n", static_cast<int32_t>(out[0]));
        }
        // workspace for batch ≤ 64 (input 3 of DFlashBlockAttention is kv_slots [B, max_kv])
        DynamicPluginTensorDesc desc[7]{};
        desc[3].max.nbDims = 2;
        desc[3].max.d[0] = 64;
        desc[3].max.d[1] = 8192;
        std::printf("workspace %zu\n", build->getWorkspaceSize(desc, nbIn, nullptr, outs));
        delete plugin;
    }
    return 0;
}
