"""Small deterministic English corpus used to train the tiny byte-level BPE tokenizer.

Topics: shapes, colours, documents, charts, signs, numbers, plus a few chat-style lines.
Everything is written inline or generated from fixed word lists (no randomness), so the
trained tokenizer is identical on every run. Reusable: `from corpus import sentences`.
"""

HANDWRITTEN = [
    "The red square sits in the top left corner of the image.",
    "A blue circle is drawn next to a green triangle.",
    "The yellow star has five points and a thin black outline.",
    "There are three orange rectangles stacked on top of each other.",
    "A purple hexagon is in the centre of the picture.",
    "The background is white with light grey stripes.",
    "Two pink ovals overlap near the bottom edge.",
    "The black line runs diagonally from corner to corner.",
    "A small brown square is hidden behind the large blue one.",
    "The picture shows a cyan diamond above a magenta arrow.",
    "The chart shows sales for each month of the year.",
    "The tallest bar in the chart is the third one.",
    "The pie chart is split into four slices of different sizes.",
    "The line chart goes up from 12 in January to 48 in June.",
    "The x axis shows the year and the y axis shows the price.",
    "The legend says that blue is revenue and red is cost.",
    "The bar for 2021 is twice as high as the bar for 2019.",
    "Each column of the table lists a city and its population.",
    "The table has five rows and three columns.",
    "The total at the bottom of the table is 1,250.",
    "The document is a one page invoice with a logo at the top.",
    "The title of the document is printed in bold capital letters.",
    "The receipt lists milk, bread, eggs and a bag of apples.",
    "The form asks for a name, an address and a phone number.",
    "The letter is dated the 3rd of March and signed by the manager.",
    "The page number is shown at the bottom right of each page.",
    "The heading says ANNUAL REPORT and the subtitle says 2024.",
    "The paragraph below the figure explains the results.",
    "A stamp in the corner reads PAID in red ink.",
    "The menu lists soup for 4 dollars and salad for 6 dollars.",
    "The road sign says STOP in white letters on a red octagon.",
    "The sign above the door reads EXIT in green letters.",
    "A yellow warning sign shows a black exclamation mark.",
    "The speed limit sign says 30.",
    "The street sign points left to the station and right to the park.",
    "The shop sign says OPEN from 9 to 5.",
    "A blue parking sign shows a large white letter P.",
    "The sign on the wall says NO SMOKING.",
    "The label on the box says FRAGILE, HANDLE WITH CARE.",
    "The poster announces a concert on Friday at 8 pm.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "The number 7 is written in large blue digits.",
    "There are 12 circles and 8 squares in the image.",
    "The sum of 25 and 17 is 42.",
    "The price went from 3.50 to 4.25 in one year.",
    "The phone number is 555 0199.",
    "The clock shows a quarter past three.",
    "The temperature is 21 degrees and the humidity is 60 percent.",
    "Half of 100 is 50 and a quarter of 100 is 25.",
    "The code on the ticket is A7 B3 C9.",
    "Describe the image in one sentence.",
    "What colour is the largest shape?",
    "How many circles are there in the picture?",
    "Read the text on the sign.",
    "What does the chart show?",
    "Compare the first image with the second image.",
    "Which bar is the highest and what is its value?",
    "Summarize the document in two sentences.",
    "Is there any text in the image?",
    "List all the shapes you can see.",
    "The image shows a red square and a blue circle.",
    "I can see three shapes: a square, a circle and a triangle.",
    "The sign says STOP.",
    "The chart shows that sales increased every month.",
    "The document is an invoice for 120 dollars.",
    "There are two images. The first one is wide and the second one is small.",
    "The first picture has stripes and the second picture has dots.",
    "Sorry, I cannot read the small text in the corner.",
    "The answer is 42.",
    "You are a helpful assistant.",
    "Hello! How can I help you today?",
    "Thank you. Can you describe it in more detail?",
    "Sure. The square is red, the circle is blue and the triangle is green.",
    "What else is in the picture?",
    "There is also a small yellow star near the bottom.",
]

SHAPES = ["square", "circle", "triangle", "rectangle", "star", "hexagon", "diamond", "oval", "arrow", "line"]
COLOURS = ["red", "blue", "green", "yellow", "orange", "purple", "black", "white", "grey", "pink", "brown", "cyan"]
PLACES = [
    "in the top left corner",
    "in the top right corner",
    "in the bottom left corner",
    "in the bottom right corner",
    "in the centre",
    "near the left edge",
    "near the right edge",
    "at the top",
    "at the bottom",
]
THINGS = ["chart", "document", "sign", "table", "receipt", "poster", "label", "page", "map", "screen"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def sentences() -> list[str]:
    out = list(HANDWRITTEN)
    # Shapes x colours x places (deterministic strided walk, not the full product).
    for i in range(120):
        shape = SHAPES[i % len(SHAPES)]
        colour = COLOURS[(i * 5) % len(COLOURS)]
        place = PLACES[(i * 7) % len(PLACES)]
        out.append(f"A {colour} {shape} is {place} of the image.")
    # Counting sentences with digits and words.
    for n in range(60):
        shape = SHAPES[(n * 3) % len(SHAPES)]
        colour = COLOURS[(n * 7) % len(COLOURS)]
        word = NUMBER_WORDS[n % len(NUMBER_WORDS)]
        out.append(f"There are {n} {colour} {shape}s, not {word}.")
    # Charts and documents with numbers.
    for k in range(60):
        thing = THINGS[k % len(THINGS)]
        value = (k * 37) % 1000
        year = 1990 + (k * 3) % 36
        out.append(f"The {thing} from {year} shows the value {value} next to a {COLOURS[k % len(COLOURS)]} mark.")
    # Signs.
    for k, word in enumerate(["STOP", "EXIT", "OPEN", "CLOSED", "SALE", "PUSH", "PULL", "DANGER", "ENTRANCE", "WAIT"]):
        out.append(f"The {COLOURS[(k * 3) % len(COLOURS)]} sign reads {word} in large letters.")
        out.append(f"What does the sign say? It says {word}.")
    return out


if __name__ == "__main__":
    s = sentences()
    print(len(s))
    print("\n".join(s[:5]))
