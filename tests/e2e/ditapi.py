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


def png_rgb8(data):
    """An 8-bit RGB PNG (what ditd encodes: colour type 2, depth 8, not
    interlaced) as (width, height, pixels): the rows' bytes R, G, B, decoded
    here with zlib and PNG's five row filters."""
    import struct
    import zlib
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert (depth, ctype, interlace) == (8, 2, 0), (depth, ctype, interlace)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + n
    assert width is not None, "no IHDR"
    raw, stride = zlib.decompress(idat), width * 3
    out, prev = bytearray(), bytearray(stride)
    for y in range(height):
        f, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = row[i - 3] if i >= 3 else 0
            b, c = prev[i], prev[i - 3] if i >= 3 else 0
            if f == 1:
                row[i] = (row[i] + a) & 255
            elif f == 2:
                row[i] = (row[i] + b) & 255
            elif f == 3:
                row[i] = (row[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            else:
                assert f == 0, f"row filter {f}"
        out += row
        prev = row
    return width, height, bytes(out)


def png_matches_raw(png, raw, width, height):
    """The largest difference, in 8-bit steps, between a PNG's pixels and a
    raw (3, H, W) f32 result quantised as ditd's PNG encoder does it
    (x * 0.5 + 0.5, clamped, * 255, rounded): 0 or 1 (rounding in doubles
    here) when the PNG holds that image."""
    import struct
    w, h, px = png_rgb8(png)
    assert (w, h) == (width, height), (w, h)
    vals = struct.unpack(f"<{3 * w * h}f", raw)
    worst = 0
    for c in range(3):
        for i in range(w * h):
            v = min(max(vals[c * w * h + i] * 0.5 + 0.5, 0.0), 1.0)
            worst = max(worst, abs(px[i * 3 + c] - round(v * 255)))
    return worst


def mp4_info(data):
    """(width, height, frames) of an MP4's first video track, read from its
    boxes (tkhd's 16.16 sizes, stsz's sample count); its sample entry must
    be H.264 ('avc1'), what ditd encodes."""
    info = {}

    def walk(buf):
        off = 0
        while off + 8 <= len(buf):
            size, kind = int.from_bytes(buf[off:off + 4], "big"), buf[off + 4:off + 8]
            assert size >= 8 and off + size <= len(buf), (kind, size, off, len(buf))
            body = buf[off + 8:off + size]
            if kind in (b"moov", b"trak", b"mdia", b"minf", b"stbl"):
                walk(body)
            elif kind == b"tkhd" and "width" not in info:
                at = 76 if body[0] == 0 else 88
                info["width"] = int.from_bytes(body[at:at + 4], "big") >> 16
                info["height"] = int.from_bytes(body[at + 4:at + 8], "big") >> 16
            elif kind == b"stsd" and "codec" not in info:
                info["codec"] = body[12:16]  # version/flags, count, then the entry's size, type
            elif kind == b"stsz" and "frames" not in info:
                info["frames"] = int.from_bytes(body[8:12], "big")
            off += size

    assert data[4:8] == b"ftyp", data[:16]
    walk(data)
    assert info.get("codec") == b"avc1", info
    return info["width"], info["height"], info["frames"]


def desc_path():
    return os.environ["DIT_DESC"]
