//! What a JSON-RPC request body asks for: its top-level `method` and `id`, read as Python's
//! `json.loads` reads them (the A2A SDK parses the body that way), in one pass.
//!
//! Two entry points, as the HTTP front door uses them:
//!
//! * [`parse_request`] for a body that arrived whole within the peek limit: the whole
//!   document is validated (a body `json.loads` refuses is not a request, so it is not
//!   work), and the last of duplicate keys wins, as in a Python dict.
//! * [`scan_head`] for the start of a body too long to inspect: only the `id` matters (the
//!   request is gated whatever it says), taken from the top-level members that end inside
//!   the prefix.
//!
//! The grammar is Python's (`json` with `strict=True`): `NaN`, `Infinity` and `-Infinity`
//! are numbers, lone `\ud800` escapes are allowed, raw control characters inside strings are
//! not. The bytes are decoded as `json.loads(bytes)` decodes them: UTF-8, UTF-16 or UTF-32
//! detected from the first bytes, with `surrogatepass`, so a lone surrogate (raw in any of
//! the three, or escaped) is valid there too. A string holding one is no A2A method name and
//! no `id` a response can carry (the SDK's own answer then fails to encode), so such a
//! `method` or `id` is read as absent: the request is classified as having none, and a
//! refusal answers `"id": null`. Nesting is followed with an explicit depth counter (no recursion), so the scan is
//! linear in the input and uses constant stack whatever the shape: where Python would give
//! up past its recursion limit (and so would the app behind the broker), this reads on; the
//! request is then classified by its method, which gates more, never less.

/// A JSON-RPC `id` as the refusal echoes it, which is as the A2A SDK echoes it: a string or
/// an integer (the text of its digits, any size), else `null` (the SDK's JSON-RPC handling
/// answers floats, booleans, containers and `null` with `null`, and cannot encode a string
/// holding a lone surrogate).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RpcId {
    /// No usable id: answered as `null`.
    Null,
    /// A string id (decoded).
    Str(String),
    /// An integer id, as its JSON digits (with a leading `-` when negative).
    Int(String),
}

/// The members of a request the front door reads.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Request {
    /// `method`, when it is a string (of Unicode scalar values: see the module comment).
    pub method: Option<String>,
    /// `id`, for the refusal.
    pub id: Option<RpcId>,
}

/// A value found at the top level that we keep.
enum Value {
    Str(String),
    Int(String),
    Other,
}

/// How many bytes at the start of `bytes` can sit in a JSON string as they are: none of `"`,
/// `\` or a control character. Eight bytes at a time: each test below is nonzero when some
/// byte of the word matches (the usual "has a zero byte" trick; it may also flag bytes past
/// the first match, never a word without one), and the word that flags is finished byte by
/// byte, so the answer is exact.
fn plain_run(bytes: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let has_zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let quote = ONES.wrapping_mul(u64::from(b'"'));
    let backslash = ONES.wrapping_mul(u64::from(b'\\'));
    let control = ONES.wrapping_mul(0x20);
    let mut words = 0usize;
    for chunk in bytes.chunks_exact(8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        let below_space = x.wrapping_sub(control) & !x & HIGH;
        if below_space | has_zero(x ^ quote) | has_zero(x ^ backslash) != 0 {
            break;
        }
        words = words.saturating_add(8);
    }
    let tail = bytes.get(words..).unwrap_or_default();
    let plain = tail
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .unwrap_or(tail.len());
    words.saturating_add(plain)
}

struct Scanner<'a> {
    bytes: &'a [u8],
    pos: usize,
}

type Step<T> = Result<T, ()>;

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn bump(&mut self) {
        self.pos = self.pos.saturating_add(1);
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.bump();
        }
    }

    fn eat(&mut self, literal: &[u8]) -> bool {
        let end = self.pos.saturating_add(literal.len());
        if self.bytes.get(self.pos..end) == Some(literal) {
            self.pos = end;
            true
        } else {
            false
        }
    }

    fn hex4(&mut self) -> Step<u32> {
        let end = self.pos.saturating_add(4);
        let digits = self.bytes.get(self.pos..end).ok_or(())?;
        let mut value = 0u32;
        for &d in digits {
            let nibble = char::from(d).to_digit(16).ok_or(())?;
            value = value.wrapping_mul(16).wrapping_add(nibble);
        }
        self.pos = end;
        Ok(value)
    }

    /// A string starting at `"`. With `keep`, its decoded text, or `None` when it holds a
    /// lone surrogate (escaped, or raw: the decoded buffer keeps those in their three-byte
    /// form), which no key, method name or echoable id can hold; without `keep`, `None`.
    fn string(&mut self, keep: bool) -> Step<Option<String>> {
        if self.peek() != Some(b'"') {
            return Err(());
        }
        self.bump();
        let mut out = Vec::new();
        let mut lone_surrogate = false;
        loop {
            // The plain run up to the next quote, backslash or control character, in one
            // pass (most of a body is such runs: message text).
            let rest = self.bytes.get(self.pos..).unwrap_or_default();
            let run = plain_run(rest);
            if keep {
                out.extend_from_slice(rest.get(..run).unwrap_or_default());
            }
            self.pos = self.pos.saturating_add(run);
            let c = self.peek().ok_or(())?; // none: the string does not end
            self.bump();
            match c {
                b'"' => break,
                b'\\' => {
                    let e = self.peek().ok_or(())?;
                    self.bump();
                    let decoded = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let unit = self.hex4()?;
                            let mut code = Some(unit);
                            // A high surrogate escape followed by a low one is one character
                            // (as Python's scanner pairs them); anything else leaves it alone.
                            if (0xd800..0xdc00).contains(&unit)
                                && self.bytes.get(self.pos..self.pos.saturating_add(2))
                                    == Some(b"\\u")
                            {
                                let save = self.pos;
                                self.pos = self.pos.saturating_add(2);
                                let low = self.hex4()?;
                                if (0xdc00..0xe000).contains(&low) {
                                    code = Some(
                                        0x10000u32
                                            .wrapping_add((unit.wrapping_sub(0xd800)) << 10)
                                            .wrapping_add(low.wrapping_sub(0xdc00)),
                                    );
                                } else {
                                    self.pos = save;
                                }
                            }
                            match code.and_then(char::from_u32) {
                                Some(decoded) => decoded,
                                None => {
                                    lone_surrogate = true;
                                    continue;
                                }
                            }
                        }
                        _ => return Err(()),
                    };
                    if keep {
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(decoded.encode_utf8(&mut buf).as_bytes());
                    }
                }
                // strict=True: control characters must be escaped (the run stops only at
                // these three kinds of byte).
                _ => return Err(()),
            }
        }
        // Raw lone surrogates (or, in a cut head, bytes that are not UTF-8) fail here.
        Ok(if keep && !lone_surrogate {
            String::from_utf8(out).ok()
        } else {
            None
        })
    }

    /// A number (or NaN / Infinity / -Infinity); returns its text when it is an integer.
    fn number(&mut self) -> Step<Option<String>> {
        let start = self.pos;
        if self.eat(b"NaN") || self.eat(b"Infinity") || self.eat(b"-Infinity") {
            return Ok(None);
        }
        if self.peek() == Some(b'-') {
            self.bump();
        }
        match self.peek() {
            Some(b'0') => self.bump(),
            Some(b'1'..=b'9') => {
                while matches!(self.peek(), Some(b'0'..=b'9')) {
                    self.bump();
                }
            }
            _ => return Err(()),
        }
        let mut integer = true;
        // Python's NUMBER_RE: a fraction or exponent that does not complete is not taken
        // (the number ends before it, and what follows then fails the grammar).
        if self.peek() == Some(b'.')
            && matches!(
                self.bytes.get(self.pos.saturating_add(1)),
                Some(b'0'..=b'9')
            )
        {
            integer = false;
            self.bump();
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.bump();
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            let save = self.pos;
            self.bump();
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.bump();
            }
            if matches!(self.peek(), Some(b'0'..=b'9')) {
                integer = false;
                while matches!(self.peek(), Some(b'0'..=b'9')) {
                    self.bump();
                }
            } else {
                self.pos = save;
            }
        }
        let text = self.bytes.get(start..self.pos).ok_or(())?;
        Ok(integer.then(|| String::from_utf8_lossy(text).into_owned()))
    }

    /// Any value, nesting followed iteratively. `keep`: decode a top-level string.
    fn value(&mut self, keep: bool) -> Step<Value> {
        match self.peek().ok_or(())? {
            b'"' => {
                return self
                    .string(keep)
                    .map(|text| text.map_or(Value::Other, Value::Str))
            }
            b'{' | b'[' => {}
            b't' if self.eat(b"true") => return Ok(Value::Other),
            b'f' if self.eat(b"false") => return Ok(Value::Other),
            b'n' if self.eat(b"null") => return Ok(Value::Other),
            _ => return self.number().map(|n| n.map_or(Value::Other, Value::Int)),
        }
        // A container: a stack of open brackets (true = object), walked without recursion.
        let mut stack: Vec<bool> = Vec::new();
        loop {
            // At the start of a value inside a container, or at an opening bracket.
            match self.peek().ok_or(())? {
                b'{' => {
                    self.bump();
                    stack.push(true);
                    self.ws();
                    if self.peek() == Some(b'}') {
                        self.bump();
                        stack.pop();
                    } else {
                        self.string(false)?;
                        self.ws();
                        if !self.eat(b":") {
                            return Err(());
                        }
                        self.ws();
                        continue;
                    }
                }
                b'[' => {
                    self.bump();
                    stack.push(false);
                    self.ws();
                    if self.peek() == Some(b']') {
                        self.bump();
                        stack.pop();
                    } else {
                        continue;
                    }
                }
                b'"' => {
                    self.string(false)?;
                }
                b't' if self.eat(b"true") => {}
                b'f' if self.eat(b"false") => {}
                b'n' if self.eat(b"null") => {}
                _ => {
                    self.number()?;
                }
            }
            // After a value: close containers or move to the next member.
            loop {
                let Some(&object) = stack.last() else {
                    return Ok(Value::Other);
                };
                self.ws();
                match self.peek().ok_or(())? {
                    b',' => {
                        self.bump();
                        self.ws();
                        if object {
                            self.string(false)?;
                            self.ws();
                            if !self.eat(b":") {
                                return Err(());
                            }
                            self.ws();
                        }
                        break;
                    }
                    b'}' if object => {
                        self.bump();
                        stack.pop();
                    }
                    b']' if !object => {
                        self.bump();
                        stack.pop();
                    }
                    _ => return Err(()),
                }
            }
        }
    }
}

fn keep_member(found: &mut Request, key: &str, value: Value) {
    match key {
        "method" => {
            found.method = match value {
                Value::Str(text) => Some(text),
                _ => None,
            }
        }
        "id" => {
            found.id = Some(match value {
                Value::Str(text) => RpcId::Str(text),
                Value::Int(digits) => RpcId::Int(digits),
                Value::Other => RpcId::Null,
            })
        }
        _ => {}
    }
}

/// Appends `code` in UTF-8's form, surrogates included (their three-byte form is what
/// Python's `surrogatepass` reads and writes; [`Scanner::string`] tells them apart).
fn push_code(out: &mut Vec<u8>, code: u32) {
    if let Some(c) = char::from_u32(code) {
        let mut buf = [0u8; 4];
        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
    } else {
        // A surrogate (0xD800..0xDFFF: the only codes below 0x110000 that are not chars).
        let byte = |bits: u32| u8::try_from(bits).unwrap_or(0);
        out.extend_from_slice(&[
            byte(0xe0 | (code >> 12)),
            byte(0x80 | ((code >> 6) & 0x3f)),
            byte(0x80 | (code & 0x3f)),
        ]);
    }
}

/// Whether `bytes` is UTF-8 as Python decodes it with `surrogatepass`: valid UTF-8 where the
/// three-byte forms of U+D800..U+DFFF are also allowed. Linear: each failed validation
/// resumes after the surrogate it stopped at.
fn is_utf8_surrogatepass(mut bytes: &[u8]) -> bool {
    loop {
        let Err(error) = std::str::from_utf8(bytes) else {
            return true;
        };
        match bytes.get(error.valid_up_to()..) {
            Some([0xed, 0xa0..=0xbf, 0x80..=0xbf, rest @ ..]) => bytes = rest,
            _ => return false,
        }
    }
}

/// Decodes a body as `json.loads(bytes)` does (`json.detect_encoding`, then the codec with
/// `surrogatepass`): UTF-8 (a leading BOM skipped), UTF-16 or UTF-32 detected from the first
/// bytes, into UTF-8 bytes in which lone surrogates keep their three-byte form. `None` when
/// Python could not decode it either (then `json.loads` raises: no request).
fn decode(body: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    let b = |i: usize| body.get(i).copied().unwrap_or(1);
    let units16 = |big: bool, skip: usize| -> Option<Cow<'_, [u8]>> {
        let data = body.get(skip..)?;
        if data.len() % 2 != 0 {
            return None;
        }
        let units = data.chunks_exact(2).map(|p| match p {
            [x, y] if big => u16::from_be_bytes([*x, *y]),
            [x, y] => u16::from_le_bytes([*x, *y]),
            _ => 0,
        });
        let mut out = Vec::with_capacity(data.len());
        for unit in char::decode_utf16(units) {
            match unit {
                Ok(c) => push_code(&mut out, u32::from(c)),
                Err(lone) => push_code(&mut out, u32::from(lone.unpaired_surrogate())),
            }
        }
        Some(Cow::Owned(out))
    };
    let units32 = |big: bool, skip: usize| -> Option<Cow<'_, [u8]>> {
        let data = body.get(skip..)?;
        if data.len() % 4 != 0 {
            return None;
        }
        let mut out = Vec::with_capacity(data.len());
        for p in data.chunks_exact(4) {
            let bytes: [u8; 4] = p.try_into().ok()?;
            let code = if big {
                u32::from_be_bytes(bytes)
            } else {
                u32::from_le_bytes(bytes)
            };
            if code > 0x10ffff {
                return None;
            }
            push_code(&mut out, code);
        }
        Some(Cow::Owned(out))
    };
    // json.detect_encoding, in its order (the UTF-8 BOM overlaps neither other BOM).
    if body.starts_with(&[0, 0, 0xfe, 0xff]) {
        return units32(true, 4);
    }
    if body.starts_with(&[0xff, 0xfe, 0, 0]) {
        return units32(false, 4);
    }
    if body.starts_with(&[0xfe, 0xff]) {
        return units16(true, 2);
    }
    if body.starts_with(&[0xff, 0xfe]) {
        return units16(false, 2);
    }
    if body.starts_with(&[0xef, 0xbb, 0xbf]) {
        let data = body.get(3..)?;
        return is_utf8_surrogatepass(data).then_some(Cow::Borrowed(data));
    }
    if body.len() >= 4 {
        if b(0) == 0 {
            return if b(1) == 0 {
                units32(true, 0)
            } else {
                units16(true, 0)
            };
        }
        if b(1) == 0 {
            return if b(2) == 0 && b(3) == 0 {
                units32(false, 0)
            } else {
                units16(false, 0)
            };
        }
    } else if body.len() == 2 {
        if b(0) == 0 {
            return units16(true, 0);
        }
        if b(1) == 0 {
            return units16(false, 0);
        }
    }
    is_utf8_surrogatepass(body).then_some(Cow::Borrowed(body))
}

/// What `json.loads(body)` would make of a whole request: `Some` with its `method` and `id`
/// when the body is a JSON object, `None` when it is invalid JSON or not an object (so not a
/// request the app runs: it answers a parse error or an invalid request).
pub fn parse_request(body: &[u8]) -> Option<Request> {
    let text = decode(body)?;
    let mut scanner = Scanner {
        bytes: &text,
        pos: 0,
    };
    scanner.ws();
    if scanner.peek() != Some(b'{') {
        // Valid JSON that is not an object is not a request either; either way, no method.
        return None;
    }
    let found = walk_object(&mut scanner, false);
    scanner.ws();
    found.filter(|_| scanner.pos == scanner.bytes.len())
}

/// `(method, id)` from the start of a request too long to parse whole: the top-level members
/// that end inside `head`, stopping at the first that does not. Read as UTF-8 bytes, not
/// decoded first (the prefix may end inside a character): a kept string that is not valid
/// UTF-8 counts as absent, and anything else that is not ASCII can only sit inside strings.
pub fn scan_head(head: &[u8]) -> Request {
    let mut scanner = Scanner {
        bytes: head,
        pos: 0,
    };
    scanner.ws();
    if scanner.peek() != Some(b'{') {
        return Request::default();
    }
    let mut found = Request::default();
    walk_members(&mut scanner, &mut found, true);
    found
}

/// Walks a top-level object from its `{`; `None` if it is not valid to its `}`.
fn walk_object(scanner: &mut Scanner<'_>, partial: bool) -> Option<Request> {
    let mut found = Request::default();
    walk_members(scanner, &mut found, partial).then_some(found)
}

/// Reads members into `found`; true when the object closed properly. With `partial`, a
/// member counts only once it is followed by `,` or `}` (a cut `12` may be `12.5`).
fn walk_members(scanner: &mut Scanner<'_>, found: &mut Request, partial: bool) -> bool {
    scanner.bump(); // the `{`
    scanner.ws();
    if scanner.peek() == Some(b'}') {
        scanner.bump();
        return true;
    }
    loop {
        scanner.ws();
        let Ok(key) = scanner.string(true) else {
            return false;
        };
        let key = key.unwrap_or_default();
        scanner.ws();
        if !scanner.eat(b":") {
            return false;
        }
        scanner.ws();
        let keep = key == "method" || key == "id";
        let Ok(value) = scanner.value(keep) else {
            return false;
        };
        scanner.ws();
        let next = scanner.peek();
        if !matches!(next, Some(b',' | b'}')) {
            return false;
        }
        if keep || !partial {
            keep_member(found, &key, value);
        }
        scanner.bump();
        if next == Some(b'}') {
            return true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: &str) -> Option<Request> {
        parse_request(body.as_bytes())
    }

    #[test]
    fn python_grammar() {
        let r = req(r#"{"jsonrpc":"2.0","id":7,"method":"SendMessage","params":{"method":"x"}}"#)
            .unwrap();
        assert_eq!(r.method.as_deref(), Some("SendMessage"));
        assert_eq!(r.id, Some(RpcId::Int("7".into())));
        let r = req(r#"{"method":"GetTask","method":"SendMessage","params":NaN,"x":-Infinity}"#)
            .unwrap();
        assert_eq!(r.method.as_deref(), Some("SendMessage"));
        assert_eq!(
            req(r#"{"method":"Send\u004dessage"}"#)
                .unwrap()
                .method
                .as_deref(),
            Some("SendMessage")
        );
        assert_eq!(req(r#"{"id":1.0}"#).unwrap().id, Some(RpcId::Null));
        assert_eq!(req(r#"{"id":"a"} x"#), None);
        assert_eq!(req("{\"id\":\"a\tb\"}"), None);
        assert_eq!(req(r#"[1]"#), None);
        assert_eq!(
            req(r#"{"a":[1,{"b":[]}],"id":-3}"#).unwrap().id,
            Some(RpcId::Int("-3".into()))
        );
        assert_eq!(req(r#"{"a":01}"#), None);
        assert_eq!(req(r#"{"a":1.}"#), None);
        let utf16: Vec<u8> =
            r#"{"method":"SendMessage"}"#.encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(
            parse_request(&utf16).unwrap().method.as_deref(),
            Some("SendMessage")
        );
    }

    #[test]
    fn lone_surrogates_decode_as_surrogatepass() {
        // Raw in UTF-8, UTF-16 and UTF-32: valid to json.loads(bytes), so still a request.
        let work = |body: &[u8]| parse_request(body).and_then(|r| r.method);
        assert_eq!(
            work(b"{\"m\":\"\xed\xa0\x80\",\"method\":\"SendMessage\"}").as_deref(),
            Some("SendMessage")
        );
        let units: Vec<u16> = r#"{"method":"SendMessage","x":"?"}"#
            .encode_utf16()
            .map(|u| if u == u16::from(b'?') { 0xdc00 } else { u })
            .collect();
        let le: Vec<u8> = units.iter().flat_map(|u| u.to_le_bytes()).collect();
        let be: Vec<u8> = units.iter().flat_map(|u| u.to_be_bytes()).collect();
        assert_eq!(work(&le).as_deref(), Some("SendMessage"));
        assert_eq!(work(&be).as_deref(), Some("SendMessage"));
        let utf32: Vec<u8> = units
            .iter()
            .flat_map(|u| u32::from(*u).to_le_bytes())
            .collect();
        assert_eq!(work(&utf32).as_deref(), Some("SendMessage"));
        // Not a code point at all: undecodable, as in Python.
        let past: Vec<u8> = units
            .iter()
            .map(|u| {
                if *u == 0xdc00 {
                    0x110000
                } else {
                    u32::from(*u)
                }
            })
            .flat_map(u32::to_le_bytes)
            .collect();
        assert_eq!(parse_request(&past), None);
        // A method or id holding one (raw or escaped) is read as absent: no A2A name has one,
        // and no response can echo it.
        let r = parse_request(br#"{"method":"SendMessage\ud800","id":"a\udc00"}"#).unwrap();
        assert_eq!((r.method, r.id), (None, Some(RpcId::Null)));
        let r = parse_request(b"{\"id\":\"\xed\xb0\x80\",\"method\":\"\\ud83d\\ude00\"}").unwrap();
        assert_eq!(
            (r.method.as_deref(), r.id),
            (Some("\u{1f600}"), Some(RpcId::Null))
        );
        assert_eq!(parse_request(b"{\"a\":\"\xed\xa0\"}"), None);
    }

    #[test]
    fn plain_runs_stop_at_the_first_special_byte() {
        for len in 0..40 {
            for special in [b'"', b'\\', 0x00, 0x1f, b'\n'] {
                for at in 0..=len {
                    let mut bytes = vec![b'a'; len];
                    bytes.extend_from_slice(&[0xff, 0x80, b' ', 0x7f]);
                    bytes.insert(at, special);
                    assert_eq!(plain_run(&bytes), at, "{len} {special} {at}");
                }
            }
            assert_eq!(plain_run(&vec![0xe9; len]), len);
        }
    }

    #[test]
    fn head_scan() {
        let r = scan_head(br#"{"jsonrpc":"2.0","id":"abc","params":{"message":"xxxx"#);
        assert_eq!(r.id, Some(RpcId::Str("abc".into())));
        let r = scan_head(br#"{"params":{"id":5},"id":12"#);
        assert_eq!(r.id, None);
        // A kept string that is not UTF-8 (a lone surrogate, or garbage) is no id to echo.
        let r = scan_head(b"{\"id\":\"\xed\xa0\x80\",\"params\":[");
        assert_eq!(r.id, Some(RpcId::Null));
        let r = scan_head(b"{\"id\":\"\xff\",\"method\":\"\xc3\xa9\",\"params\":\"\xff");
        assert_eq!(
            (r.method.as_deref(), r.id),
            (Some("\u{e9}"), Some(RpcId::Null))
        );
    }

    #[test]
    fn adversarial_bodies_are_linear() {
        let started = std::time::Instant::now();
        let deep = "[".repeat(1 << 20);
        let _ = parse_request(format!("{{\"a\":{deep}").as_bytes());
        let _ = scan_head(format!("{{\"a\":{deep}").as_bytes());
        let quotes = "\\\"".repeat(1 << 19);
        let _ = parse_request(format!("{{\"a\":\"{quotes}").as_bytes());
        let members = "\"a\":1,".repeat(1 << 17);
        let _ = scan_head(format!("{{{members}").as_bytes());
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}
