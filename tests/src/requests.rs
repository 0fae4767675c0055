//! Builders for public API requests in the end-to-end tests: a user turn of text and image parts,
//! and images that are bad in a chosen way (a PNG header claiming any size, a real PNG of any size).

use glance_proto::v1 as pb;

/// A request for `max_new_tokens` tokens with the server's default decoding.
pub fn request(messages: Vec<pb::ChatMessage>, max_new_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest { messages, max_new_tokens, stop: vec![], decoding: None }
}

/// One user message made of `parts`.
pub fn user(parts: Vec<pb::content_part::Part>) -> Vec<pb::ChatMessage> {
    vec![pb::ChatMessage {
        role: "user".into(),
        content: parts.into_iter().map(|p| pb::ContentPart { part: Some(p) }).collect(),
    }]
}

pub fn image(data: Vec<u8>, mime: &str) -> pb::content_part::Part {
    pb::content_part::Part::Image(pb::Image { data, mime_type: mime.into() })
}

pub fn text(t: &str) -> pb::content_part::Part {
    pb::content_part::Part::Text(t.into())
}

/// A PNG whose header claims `width`×`height` (valid CRCs, no pixel data worth decoding).
pub fn png_claiming(width: u32, height: u32) -> Vec<u8> {
    let mut header = width.to_be_bytes().to_vec();
    header.extend(height.to_be_bytes());
    header.extend([8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    push_chunk(&mut png, b"IHDR", &header);
    push_chunk(&mut png, b"IDAT", &[0x78, 0x9c, 0x03, 0x00]);
    push_chunk(&mut png, b"IEND", &[]);
    png
}

/// A real, decodable grey PNG of `width`×`height`.
pub fn png_of_size(width: u32, height: u32) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(width, height, image::Rgb([128, 128, 128]));
    let mut bytes = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png).expect("PNG encodes");
    bytes
}

fn push_chunk(png: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    png.extend((data.len() as u32).to_be_bytes());
    let mut body = kind.to_vec();
    body.extend(data);
    png.extend(&body);
    png.extend(crc32(&body).to_be_bytes());
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}
