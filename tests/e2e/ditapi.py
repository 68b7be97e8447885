"""The ditserve API for Python tests, built at run time from the descriptor
set the build writes (proto/ditserve.desc): message classes and call helpers
over plain grpcio, with no generated code. This is the interop proof: a
client written against the .proto, in another language and gRPC stack."""

import os

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


class Api:
    def __init__(self, desc_path):
        with open(desc_path, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
        self.pool = descriptor_pool.DescriptorPool()
        for fd in fds.file:
            self.pool.Add(fd)
        self._classes = {}

    def msg(self, full_name):
        cls = self._classes.get(full_name)
        if cls is None:
            d = self.pool.FindMessageTypeByName(full_name)
            if hasattr(message_factory, "GetMessageClass"):
                cls = message_factory.GetMessageClass(d)
            else:
                cls = message_factory.MessageFactory(self.pool).GetPrototype(d)
            self._classes[full_name] = cls
        return cls

    def enum(self, full_name, value_name):
        return self.pool.FindEnumTypeByName(full_name).values_by_name[value_name].number

    # Method handles -----------------------------------------------------
    def _method(self, channel, path, req_type, resp_type, kind):
        resp = self.msg(resp_type)
        ser = lambda m: m.SerializeToString()
        if kind == "unary":
            return channel.unary_unary(path, request_serializer=ser,
                                       response_deserializer=resp.FromString)
        if kind == "stream":
            return channel.unary_stream(path, request_serializer=ser,
                                        response_deserializer=resp.FromString)
        return channel.stream_stream(path, request_serializer=ser,
                                     response_deserializer=resp.FromString)

    def generate(self, ch):
        return self._method(ch, "/ditserve.v1.Generation/Generate", "ditserve.v1.GenerateRequest",
                            "ditserve.v1.GenerateEvent", "stream")

    def server_info(self, ch):
        return self._method(ch, "/ditserve.v1.Generation/GetServerInfo",
                            "ditserve.v1.GetServerInfoRequest", "ditserve.v1.ServerInfo", "unary")

    def list_models(self, ch):
        return self._method(ch, "/ditserve.v1.Generation/ListModels",
                            "ditserve.v1.ListModelsRequest", "ditserve.v1.ListModelsResponse", "unary")

    def warmup(self, ch):
        return self._method(ch, "/ditserve.v1.Generation/Warmup", "ditserve.v1.WarmupRequest",
                            "ditserve.v1.WarmupResponse", "unary")

    def lora_rpc(self, ch, name):
        """ListLoras, LoadLora or UnloadLora."""
        return self._method(ch, f"/ditserve.v1.Generation/{name}", f"ditserve.v1.{name}Request",
                            f"ditserve.v1.{name}Response", "unary")

    def health_check(self, ch):
        return self._method(ch, "/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest",
                            "grpc.health.v1.HealthCheckResponse", "unary")

    def health_watch(self, ch):
        return self._method(ch, "/grpc.health.v1.Health/Watch", "grpc.health.v1.HealthCheckRequest",
                            "grpc.health.v1.HealthCheckResponse", "stream")

    def reflection(self, ch, version="v1"):
        return self._method(ch, f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                            f"grpc.reflection.{version}.ServerReflectionRequest",
                            f"grpc.reflection.{version}.ServerReflectionResponse", "bidi")

    # Requests -----------------------------------------------------------
    def request(self, **fields):
        """A GenerateRequest; guidance_scale, true_cfg_scale and seed are
        plain numbers here and go into their wrapper messages."""
        r = self.msg("ditserve.v1.GenerateRequest")()
        for k, v in fields.items():
            if k in ("guidance_scale", "true_cfg_scale", "seed"):
                getattr(r, k).value = v
            elif k in ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                       "negative_pooled_prompt_embeds", "latents"):
                dtype, shape, data = v
                t = getattr(r, k)
                t.dtype = self.enum("ditserve.v1.DType", dtype)
                t.shape.extend(shape)
                t.data = data
            elif k == "loras":
                for name, scale in v:
                    u = r.loras.add()
                    u.name = name
                    u.scale = scale
            elif k == "output_format":
                r.output_format = self.enum("ditserve.v1.OutputFormat", v)
            else:
                setattr(r, k, v)
        return r


def collect(events):
    """Reads a Generate stream into (list of event kinds, image bytes, Result)."""
    kinds, chunks, result = [], [], None
    for ev in events:
        kind = ev.WhichOneof("event")
        kinds.append(kind)
        if kind == "chunk":
            assert ev.chunk.offset == sum(len(c) for c in chunks), "chunks out of order"
            chunks.append(ev.chunk.data)
        elif kind == "result":
            result = ev.result
    return kinds, b"".join(chunks), result


def collect_images(events):
    """Reads a Generate stream of one or more images (num_images) into (list
    of each image's bytes, Result): each image's chunks come in turn
    (ResultChunk.image_index), offsets within the image, and their sizes
    must be Result.image_bytes."""
    images, result = {}, None
    for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "chunk":
            buf = images.setdefault(ev.chunk.image_index, b"")
            assert ev.chunk.offset == len(buf), "chunks out of order"
            images[ev.chunk.image_index] = buf + ev.chunk.data
        elif kind == "result":
            result = ev.result
    assert result is not None, "no result"
    out = [images[k] for k in sorted(images)]
    assert [len(x) for x in out] == list(result.image_bytes), (result.image_bytes, len(out))
    return out, result


def desc_path():
    return os.environ["DIT_DESC"]
