// Loads the plugin library on CPU (no CUDA call happens before enqueue) and prints what TensorRT
// would see. tests/test_plugins.py compares it with dflash_trt/kernels/plugin_spec.py.
//
//   abi_probe                          creators, attributes, outputs, aliases, dtypes
//   abi_probe PLUGIN [name=value ...]  "created" and its workspace for batch <= 64, or "refused"
#include <NvInferRuntime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace
{

IPluginCreatorV3One* findCreator(char const* name)
{
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    for (int32_t c = 0; c < n; ++c)
    {
        auto* creator = static_cast<IPluginCreatorV3One*>(creators[c]);
        if (std::strcmp(creator->getPluginName(), name) == 0)
        {
            return creator;
        }
    }
    return nullptr;
}

// The attribute's type as the creator declares it (int32 for a name it does not know).
PluginFieldType declaredType(IPluginCreatorV3One* creator, std::string const& name)
{
    PluginFieldCollection const* fields = creator->getFieldNames();
    for (int32_t f = 0; f < fields->nbFields; ++f)
    {
        if (name == fields->fields[f].name)
        {
            return fields->fields[f].type;
        }
    }
    return PluginFieldType::kINT32;
}

// Workspace for batch <= 64 (input 3 of DFlashBlockAttention is kv_slots [B, max_kv]); 0 for the others.
size_t workspace(IPluginV3* plugin)
{
    auto* build = static_cast<IPluginV3OneBuildV2*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    DynamicPluginTensorDesc desc[7]{};
    desc[3].max.nbDims = 2;
    desc[3].max.d[0] = 64;
    desc[3].max.d[1] = 8192;
    return build->getWorkspaceSize(desc, 7, nullptr, build->getNbOutputs());
}

int create(char const* pluginName, int argc, char** argv)
{
    IPluginCreatorV3One* creator = findCreator(pluginName);
    if (creator == nullptr)
    {
        std::fprintf(stderr, "no plugin %s\n", pluginName);
        return 1;
    }
    std::vector<std::string> names(static_cast<size_t>(argc));
    std::vector<int32_t> ints(static_cast<size_t>(argc));
    std::vector<float> floats(static_cast<size_t>(argc));
    std::vector<PluginField> fields;
    for (int a = 0; a < argc; ++a)
    {
        std::string const arg = argv[a];
        size_t const eq = arg.find('=');
        if (eq == std::string::npos)
        {
            std::fprintf(stderr, "expected name=value, got %s\n", argv[a]);
            return 1;
        }
        names[a] = arg.substr(0, eq);
        char const* value = argv[a] + eq + 1;
        if (declaredType(creator, names[a]) == PluginFieldType::kFLOAT32)
        {
            floats[a] = std::strtof(value, nullptr);
            fields.emplace_back(names[a].c_str(), &floats[a], PluginFieldType::kFLOAT32, 1);
        }
        else
        {
            ints[a] = static_cast<int32_t>(std::strtol(value, nullptr, 10));
            fields.emplace_back(names[a].c_str(), &ints[a], PluginFieldType::kINT32, 1);
        }
    }
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    IPluginV3* plugin = creator->createPlugin("probe", &fc, TensorRTPhase::kBUILD);
    if (plugin == nullptr)
    {
        std::printf("refused\n");
        return 0;
    }
    std::printf("created\nworkspace %zu\n", workspace(plugin));
    delete plugin;
    return 0;
}

} // namespace

int main(int argc, char** argv)
{
    if (argc > 1)
    {
        return create(argv[1], argc - 2, argv + 2);
    }
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
        // create with one attribute changed (to 16: valid for every plugin), then read it back as TensorRT serializes it
        int32_t sixteen = 16;
        PluginField changed(fields->fields[0].name, &sixteen, PluginFieldType::kINT32, 1);
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
        delete plugin;
    }
    return 0;
}
